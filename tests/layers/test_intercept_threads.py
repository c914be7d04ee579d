"""NNX interception stays in the thread that traces a step.

Two engines trace their steps at the same time in two threads while a
third thread calls a plain NNX block of the same class. Events inside the
traced ``loss_fn`` make the overlap certain and its order the one that
left a class wrapped when each trace saved and restored ``__call__`` on
its own: the first engine enters, the second enters, the first leaves,
then the second.
"""

import concurrent.futures
import threading

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import zero_jax as zj

D, LAYERS, N = 16, 4, 8
_WAIT_S = 120  # (a missed event fails the test instead of hanging it)


class Block(nnx.Module):
  """A residual MLP block."""

  def __init__(self, d, *, rngs):
    self.up = nnx.Linear(d, 2 * d, rngs=rngs)
    self.down = nnx.Linear(2 * d, d, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jnp.tanh(self.up(x)))


class Model(nnx.Module):
  """``LAYERS`` blocks and a head."""

  def __init__(self, *, rngs):
    self.blocks = nnx.List([Block(D, rngs=rngs) for _ in range(LAYERS)])
    self.head = nnx.Linear(D, 1, rngs=rngs)


def _loss(graphdef, hook):
  """A loss that calls the blocks in a Python loop and ``hook[0]()``
  halfway through them (while the step is traced)."""

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    x = batch["x"]
    for i, block in enumerate(model.blocks):
      x = block(x)
      if i == LAYERS // 2 - 1:
        hook[0]()
    return jnp.mean((model.head(x) - batch["y"]) ** 2)

  return loss_fn


def _wait(event, what):
  if not event.wait(_WAIT_S):
    raise TimeoutError(f"waited {_WAIT_S} s for {what}")


def _own_calls():
  """``{class: its own __call__}`` of every NNX Module class."""
  found, stack = {}, [nnx.Module]
  while stack:
    for sub in type.__subclasses__(stack.pop()):
      if sub not in found:
        found[sub] = vars(sub).get("__call__")
        stack.append(sub)
  return found


def test_concurrent_traces_see_their_own_context_and_others_see_none():
  graphdef, params = nnx.split(Model(rngs=nnx.Rngs(0)), nnx.Param)
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(16, D)).astype(np.float32),
           "y": rng.normal(size=(16, 1)).astype(np.float32)}
  # The engines: blocks found in the parameter tree, and named.
  configs = {"found": None, "named": ("Block",)}

  def engine(classes, hook):
    return zj.Engine(_loss(graphdef, hook), optax.adam(1e-3),
                     zj.ZeroConfig(stage=3, min_shard_elements=0,
                                   layer_classes=classes),
                     zj.make_mesh(num_devices=N))

  def run(eng, state):
    text = eng.step.lower(state, batch).as_text()
    _, metrics = eng.step(state, batch)
    return text, float(metrics["loss"])

  # Each step traced alone first.
  alone = {}
  for name, classes in configs.items():
    eng = engine(classes, [lambda: None])
    alone[name] = run(eng, eng.init(params))
    assert eng.units_seen == {"Block": LAYERS}, name

  plain = Block(D, rngs=nnx.Rngs(7))
  x = rng.normal(size=(8, D)).astype(np.float32)
  expected = np.asarray(plain(x))
  before = _own_calls()
  own_call = vars(Block)["__call__"]

  found_in, named_in, checked, found_done, all_done = (
      threading.Event() for _ in range(5))

  def found_hook():  # the first to enter, and to leave
    found_in.set()
    _wait(named_in, "the second trace to enter")
    _wait(checked, "the plain block to be called during both traces")

  def named_hook():
    named_in.set()
    _wait(found_done, "the first trace to leave")

  engines = {"found": engine(configs["found"], [found_hook]),
             "named": engine(configs["named"], [named_hook])}
  states = {name: eng.init(params) for name, eng in engines.items()}

  def trace_found():
    try:
      return run(engines["found"], states["found"])
    finally:
      found_done.set()

  def trace_named():
    _wait(found_in, "the first trace to enter")
    return run(engines["named"], states["named"])

  def call_plain():
    _wait(found_in, "the first trace to enter")
    _wait(named_in, "the second trace to enter")
    calls = 0
    while True:
      stop = all_done.is_set()  # (one more call after both traces left)
      np.testing.assert_array_equal(np.asarray(plain(x)), expected)
      calls += 1
      checked.set()
      if stop:
        return calls

  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    plain_calls = pool.submit(call_plain)
    traced = {"found": pool.submit(trace_found),
              "named": pool.submit(trace_named)}
    try:
      got = {name: f.result() for name, f in traced.items()}
    finally:
      all_done.set()
      # (Unblocks the others if one failed before the events were set.)
      for event in (found_in, named_in, checked, found_done):
        event.set()
    assert plain_calls.result() >= 2

  for name, eng in engines.items():
    assert eng.units_seen == {"Block": LAYERS}, name
    assert f"Block x{LAYERS}" in eng.describe(), name
    text, loss = got[name]
    assert loss == alone[name][1], name
    assert text == alone[name][0], name
  # Nothing left wrapped: every class has its own __call__ object back.
  assert vars(Block)["__call__"] is own_call
  after = _own_calls()
  changed = [cls.__qualname__ for cls, call in before.items()
             if after.get(cls) is not call]
  assert not changed, changed
  np.testing.assert_array_equal(np.asarray(plain(x)), expected)
