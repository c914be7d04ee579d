"""The model's own layout: which dimensions of each parameter the user's
model splits over mesh axes (tensor parallelism over ``model``).

ZeRO decides only where ``data`` goes; how a parameter splits over
``model`` is the model author's decision, written in one of the ways JAX
and Flax users already write it. ``model_specs`` reads it from, in order
(the first source a tree has is used for the whole tree):

1. an explicit pytree of ``PartitionSpec``;
2. Flax metadata: Linen ``nn.Partitioned`` boxes (mesh axis names),
   ``nn.LogicallyPartitioned`` boxes (logical names, mapped by logical axis
   rules) and NNX Variables with ``out_sharding`` metadata
   (``nnx.with_partitioning``, ``nnx.Param(..., out_sharding=...)``);
3. the shardings of ``jax.Array`` / ``jax.ShapeDtypeStruct`` leaves;
4. otherwise nothing is split.

Whatever the source, the result is checked against the mesh, so that a
mistake in a spec is reported here, naming the parameter, rather than as a
shape error deep inside a compiled step.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import (AbstractMesh, Mesh, NamedSharding,
                          PartitionSpec as P)

from zero_jax._paths import path_str
from zero_jax.layout._mesh import DATA, MODEL, REPLICA

# Per dimension: None (whole) or the mesh axes it is split over, in order.
LeafSpec = tuple[tuple[str, ...] | None, ...]

# Keys under which NNX Variables have kept their sharding annotation: flax
# 0.12 writes ``out_sharding`` and still accepts the older two as aliases.
_NNX_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")

_AXES_HINT = (
    f"zero_jax's mesh axes are {DATA!r}, {MODEL!r} and {REPLICA!r}: map "
    f"tensor-parallel names to {MODEL!r} (e.g. the logical axis rule "
    f"('mlp', {MODEL!r})) and names that stay whole to None (('embed', "
    "None))")


def model_specs(params: Any, mesh: Mesh | AbstractMesh, *, specs: Any = None,
                rules: Sequence[tuple[str, Any]] | None = None
                ) -> list[LeafSpec]:
  """How the user's model splits each parameter over the mesh.

  Sources, the first one present wins for the whole tree:

  * ``specs``: a pytree of ``PartitionSpec`` (or ``NamedSharding``) with
    the structure of ``params``, boxes and NNX Variables included (what
    ``nn.get_partition_spec`` / ``nnx.get_partition_spec`` return fits); a
    ``None`` leaf means not split. A prefix of the structure works too: a
    spec at an inner node applies to every leaf below it.
  * Flax metadata, read as Flax reads it. Linen ``nn.Partitioned`` names
    mesh axes. ``nn.LogicallyPartitioned`` names logical axes, mapped by
    ``flax.linen.logical_to_mesh_axes`` with the box's own rules if it has
    them, else ``rules``, else the rules of an enclosing
    ``nn.logical_axis_rules``; as in Flax, a logical name no rule maps is
    not split, but a box with logical names and no rules anywhere is an
    error (pass ``rules=()`` to leave them all whole). NNX Variables with
    ``out_sharding`` metadata are read by ``nnx.get_partition_spec``, under
    ``nnx.logical_axis_rules(rules)`` when ``rules`` is given; as in NNX, a
    name no rule maps is taken as a mesh axis name. Leaves without metadata
    in such a tree are not split.
  * The ``NamedSharding`` of ``jax.Array`` / ``jax.ShapeDtypeStruct``
    leaves (e.g. parameters created under ``jax.set_mesh``).
  * Otherwise no leaf is split.

  A mesh that a box or Variable carries is not consulted: names are checked
  against ``mesh``. Axes of size 1 are dropped, and so is ``'model'`` where
  the mesh has no such axis (``make_mesh`` leaves it out when ``model=1``):
  splitting over one device is no split, so a tensor-parallel model runs
  unchanged on a mesh without model parallelism, and an entry that is not
  None always means a real split.

  Args:
    params: the parameter pytree (arrays or ``ShapeDtypeStruct``), Flax
      boxes and NNX Variables included (e.g. ``nnx.split(model,
      nnx.Param)[1]`` or Linen's ``variables["params"]``).
    mesh: the mesh (a ``Mesh`` or ``AbstractMesh``) from ``make_mesh``.
    specs: explicit specs, see above.
    rules: logical axis rules, ``((logical name, mesh axes or None),
      ...)``, for parameters annotated with logical names.

  Returns:
    For each leaf of ``jax.tree.leaves(params)``, in order, one entry per
    dimension: None (not split) or the tuple of mesh axis names the
    dimension is split over, e.g. ``("model",)`` or ``("data", "model")``.

  Raises:
    ValueError: naming the leaf, its spec and the fix, when a spec names
      an axis the mesh lacks or ``'replica'``, has more entries than the
      leaf has dimensions, splits a dimension its axes' sizes do not
      divide, or uses one axis twice; when ``specs`` does not have the
      structure of ``params``; or when logical names come without rules.
  """
  rules = _checked_rules(rules)
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  if specs is not None:
    found = _from_specs(params, specs)
  else:
    found = _from_flax(params, rules)
    if found is None:
      found = [_from_sharding(path, x) for path, x in leaves]
  if len(found) != len(leaves):
    # (Each source yields one spec per leaf by construction.)
    raise AssertionError(f"{len(found)} specs for {len(leaves)} leaves")
  return [_checked(path_str(path), np.shape(x), spec, source, mesh)
          for (path, x), (spec, source) in zip(leaves, found)]


def is_model_parallel(leaf_specs: Sequence[LeafSpec]) -> bool:
  """Whether any leaf of ``model_specs``'s result is split over
  ``'model'``."""
  return any(entry is not None and MODEL in entry
             for spec in leaf_specs for entry in spec)


# --------------------------------------------------------------- sources

# Each source returns, per leaf of ``jax.tree.leaves(params)``, the raw spec
# (a PartitionSpec, or None for "not split") and where it came from, for
# the error messages.
_Found = list[tuple[P | None, str]]


def _text(spec: Any) -> str:
  """A spec as ``P(None, 'model')`` (``PartitionSpec``'s own repr differs
  between JAX versions)."""
  return f"P({', '.join(repr(e) for e in spec)})"


def _is_spec(x: Any) -> bool:
  return x is None or isinstance(x, (P, NamedSharding))


def _from_specs(params: Any, specs: Any) -> _Found:
  """One spec per leaf from the user's spec tree (a prefix of params)."""
  spec_leaves, treedef = jax.tree_util.tree_flatten_with_path(
      specs, is_leaf=_is_spec)
  for path, spec in spec_leaves:
    if not _is_spec(spec):
      raise ValueError(
          f"specs at {path_str(path)}: {spec!r} is not a PartitionSpec, "
          "NamedSharding or None. Write jax.sharding.PartitionSpec(None, "
          f"{MODEL!r}), not a tuple or a string: a tuple is a pytree node, "
          "so its entries were taken as separate leaves.")
  try:
    subtrees = treedef.flatten_up_to(params)
  except (ValueError, TypeError) as e:
    raise ValueError(
        "specs does not have the structure of params (nor of a prefix of "
        "it): give one PartitionSpec or None per parameter, in a tree "
        "shaped like params (nn.get_partition_spec(params) or "
        f"nnx.get_partition_spec(state) make one). Mismatch: {e}") from e
  found: _Found = []
  for (_, spec), subtree in zip(spec_leaves, subtrees):
    if isinstance(spec, NamedSharding):
      spec = spec.spec
    found += [(spec, "specs gives")] * len(jax.tree.leaves(subtree))
  return found


def _flax():
  """Flax's Linen and NNX modules, imported only when specs are read (so
  that ``zero_jax.layout`` itself does not load Flax)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return nn, nnx


def _nnx_names(variable: Any) -> Any:
  """The sharding annotation an NNX Variable carries, or None."""
  metadata = variable.get_metadata()
  for key in _NNX_SHARDING_KEYS:
    if metadata.get(key):
      return metadata[key]
  return None


def _from_flax(params: Any, rules: tuple | None) -> _Found | None:
  """One spec per leaf from Flax boxes and Variables; None when the tree
  carries no sharding metadata at all."""
  nn, nnx = _flax()
  is_box = lambda x: isinstance(x, (nn.Partitioned, nnx.Variable))
  items = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)[0]
  if not any(isinstance(x, nn.Partitioned) or
             (isinstance(x, nnx.Variable) and _nnx_names(x) is not None)
             for _, x in items):
    return None
  found: _Found = []
  for path, item in items:
    n = len(jax.tree.leaves(item))
    if isinstance(item, nn.LogicallyPartitioned):
      found += [_linen_logical(nn, path, item, rules)] * n
    elif isinstance(item, nn.Partitioned):
      found += [(item.get_partition_spec(), "nn.Partitioned names")] * n
    elif isinstance(item, nnx.Variable) and _nnx_names(item) is not None:
      found += [_nnx_spec(nnx, path, item, rules)] * n
    else:
      found += [(None, "no metadata")] * n
  return found


def _linen_logical(nn: Any, path: Any, box: Any,
                   rules: tuple | None) -> tuple[P | None, str]:
  """A Linen ``LogicallyPartitioned`` box's mesh spec, as Flax maps it."""
  names = box.get_partition_spec()
  where = f"{path_str(path)}: nn.LogicallyPartitioned names {_text(names)}"
  for given in (box.rules, rules, nn.get_logical_axis_rules() or None):
    if given is not None:
      break
  else:
    if any(isinstance(n, str) for n in names):
      raise ValueError(
          f"{where} but no logical axis rules were given, so Flax would "
          "split nothing. Pass the rules (e.g. rules=(('embed', None), "
          f"('mlp', {MODEL!r}))) or set them with nn.logical_axis_rules; "
          "rules=() leaves every logical dimension whole.")
    given = ()
  try:
    spec = nn.logical_to_mesh_axes(names, given)
  except ValueError as e:
    raise ValueError(f"{where} with rules {given}: {e}") from e
  return spec, (f"nn.LogicallyPartitioned names {_text(names)} map by the "
                "rules to")


def _nnx_spec(nnx: Any, path: Any, variable: Any,
              rules: tuple | None) -> tuple[P | None, str]:
  """An NNX Variable's mesh spec, as ``nnx.get_partition_spec`` reads it."""
  names = _nnx_names(variable)
  context = (nnx.logical_axis_rules(rules) if rules is not None
             else contextlib.nullcontext())
  try:
    with context:
      out = nnx.get_partition_spec(variable)
  except ValueError as e:  # (inconsistent context and Variable rules)
    raise ValueError(f"{path_str(path)}: NNX out_sharding {names}: {e}") \
        from e
  specs = jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, P))
  if len(specs) != 1 or not isinstance(specs[0], P):
    raise TypeError(
        f"{path_str(path)}: nnx.get_partition_spec gave {out!r} for a "
        f"Variable annotated {names}, not one PartitionSpec; this Flax "
        "version is not supported here: pass specs= explicitly.")
  return specs[0], f"NNX out_sharding {tuple(names)} gives"


def _from_sharding(path: Any, x: Any) -> tuple[P | None, str]:
  """The spec of an array's (or ShapeDtypeStruct's) own sharding."""
  sharding = getattr(x, "sharding", None)
  if sharding is None:
    return None, "no sharding"
  if isinstance(sharding, NamedSharding):
    return sharding.spec, "its array's NamedSharding has"
  if sharding.is_fully_replicated:  # (one device, or a replicated GSPMD)
    return None, "no sharding"
  raise ValueError(
      f"{path_str(path)}: the array is split by a "
      f"{type(sharding).__name__}, which names no mesh axes. Place it with "
      "a jax.sharding.NamedSharding on the mesh, or pass specs=.")


# ------------------------------------------------------------ validation


def _checked_rules(rules: Any) -> tuple | None:
  """``rules`` as a tuple of ``(name, axes)`` pairs (hashable axes)."""
  if rules is None:
    return None
  out = []
  for rule in rules:
    if (not isinstance(rule, (tuple, list)) or len(rule) != 2 or
        not isinstance(rule[0], str)):
      raise ValueError(
          f"rules: {rule!r} is not a (logical name, mesh axes) pair; write "
          f"rules like (('embed', None), ('mlp', {MODEL!r})).")
    axes = rule[1]
    out.append((rule[0], tuple(axes) if isinstance(axes, list) else axes))
  return tuple(out)


def _axis_names(entry: Any, where: str) -> tuple[str, ...]:
  """One spec entry as a tuple of axis names (empty: not split)."""
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  if isinstance(entry, (tuple, list)) and all(isinstance(a, str)
                                              for a in entry):
    return tuple(entry)
  raise ValueError(
      f"{where}: entry {entry!r} is not None, a mesh axis name or a tuple "
      "of them; parameters need a definite layout (no "
      "PartitionSpec.UNCONSTRAINED).")


def _checked(path: str, shape: tuple[int, ...], spec: P | None,
             source: str, mesh: Mesh | AbstractMesh) -> LeafSpec:
  """The validated, normalized spec of one leaf."""
  entries = tuple(spec) if spec is not None else ()
  where = f"{path} (shape {tuple(shape)}): {source} {_text(entries)}"
  if len(entries) > len(shape):
    raise ValueError(
        f"{where}: {len(entries)} entries for a leaf of rank {len(shape)}. "
        "Give at most one entry per dimension (fix the spec, or the "
        "metadata or rules that produce it).")
  sizes = dict(mesh.shape)
  first: dict[str, int] = {}
  out: list[tuple[str, ...] | None] = []
  for d, entry in enumerate(entries):
    names = _axis_names(entry, where)
    for name in names:
      if name == REPLICA:
        raise ValueError(
            f"{where}: dimension {d} is split over {REPLICA!r}, but replica "
            "groups hold whole copies of the state. Split it over "
            f"{MODEL!r} (tensor parallelism) or leave it None; ZeRO adds "
            f"{DATA!r} itself.")
      if name not in sizes and name != MODEL:
        raise ValueError(
            f"{where}: axis {name!r} is not in the mesh (axes "
            f"{tuple(mesh.axis_names)}). {_AXES_HINT}.")
      if name in first:
        raise ValueError(
            f"{where}: axis {name!r} splits dimension {first[name]} and "
            f"dimension {d}; an axis can split one dimension only: keep it "
            "on one of them.")
      first[name] = d
    kept = tuple(a for a in names if sizes.get(a, 1) > 1)
    k = math.prod(sizes[a] for a in kept)
    if shape[d] % k:
      raise ValueError(
          f"{where}: dimension {d} has size {shape[d]}, which {kept} "
          f"(size {k} on this mesh) does not divide. Make the dimension a "
          f"multiple of {k}, use a mesh where it divides "
          "(make_mesh(model=...)), or leave the dimension whole (None).")
    out.append(kept or None)
  return tuple(out) + (None,) * (len(shape) - len(entries))
