"""Reading a traced step's jaxpr: its scans, and its copies between memory
spaces (offload moves each layer inside the layer loop)."""


def _inner(eqn):
  """The jaxprs nested in an equation's parameters."""
  for v in eqn.params.values():
    for inner in (v if isinstance(v, (tuple, list)) else (v,)):
      inner = getattr(inner, "jaxpr", inner)
      if hasattr(inner, "eqns"):
        yield inner


def copies_to(jaxpr, space: str) -> int:
  """device_put equations into memory space ``space`` ("Device" or
  "Host") in ``jaxpr``, nested ones included."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "device_put":
      n += sum(space in str(d) for d in eqn.params.get("devices", ()))
    n += sum(copies_to(inner, space) for inner in _inner(eqn))
  return n


def scan_bodies(jaxpr):
  """The body of every scan in ``jaxpr``, nested ones included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      yield eqn.params["jaxpr"].jaxpr
    for inner in _inner(eqn):
      yield from scan_bodies(inner)


def layer_loops(jaxpr):
  """The scans that multiply: a model's layer loops (a streamed update's
  scans do not)."""
  return [body for body in scan_bodies(jaxpr) if "dot_general" in str(body)]
