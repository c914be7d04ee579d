"""Per-layer ZeRO for Flax NNX and Linen models with scanned (stacked) layers.

``zero_jax.scan_layers`` gathers (stage 3) or reduce-scatters the gradients
of (stage 2) one layer at a time, but only for parameter arrays that reach it
as its ``xs``. Flax models usually scan their layers with ``nnx.scan`` or
``nn.scan``, which never see ``scan_layers``. The two adapters here run the
same stacked layers through ``scan_layers`` without rewriting them:

* ``scan_nnx(layers, x, ...)`` runs a stacked NNX module (made with the
  usual ``nnx.vmap`` over split rngs) layer by layer.
* ``scan_linen(Block, variable_axes={"params": 0},
  split_rngs={"params": True}, length=L)`` is a drop-in for the same call of
  ``nn.scan``: same parameter tree, same initial values, but applied through
  ``scan_layers``.

What a model that uses neither costs (it still trains exactly, at every
stage): the engine hands ``loss_fn`` full parameters made where ``loss_fn``
starts. At stage 3 it all-gathers every sharded leaf there, so all full
parameters stay live through forward and backward; and a stacked leaf's
gradient, the scan's accumulated ``(L, ...)`` buffer, is reduce-scattered
only after backward has passed every layer. The step's temporaries then hold
the whole model's full parameters *and* full gradients, more than at stages
1-2. At stage 2 each gradient is reduce-scattered once backward has produced
all of it, for a stacked leaf again after the last layer: all layers' full
gradients are live at once, stage 1's memory. (``python
experiments/adapter_memory.py``: on a residual-MLP stack, d=128, 8 layers,
8 devices, Adam, step temporaries per device are 10.96 MiB at stage 3 and
6.03 MiB at stage 2 with ``nnx.scan``, 1.30 and 2.02 MiB with
``scan_nnx``.) With an adapter one layer's full parameters and gradients are
live at a time. The price, at stage 3 under the default remat
(``ZeroConfig.remat="full"``), is gathering each layer again in backward:
up to 1.5x the collective volume (all-gather 2x, reduce-scatter 1x the
parameters, instead of 1x each).

The adapters find the parameters by identity: ``loss_fn`` must hand the
arrays the engine gave it to the model unchanged. ``nnx.merge(graphdef,
params)`` (with ``copy`` True or False) and ``model.apply({"params":
params}, ...)`` do; anything that makes new arrays does not: casting the
parameters in ``loss_fn`` (for bf16 compute use ``ZeroConfig.compute_dtype``
instead: the engine casts before handing them over), or a transform around
the model call outside the adapter (``jax.checkpoint``, ``nnx.remat``,
``nn.remat(Model)``; inside the layer they are fine). Then the model still
trains exactly, but at the coarse cost above.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax import nnx

from zero_jax.layers._scan import scan_layers

# ---------------------------------------------------------------------- NNX


def scan_nnx(layers: nnx.Module, x: Any, *args: Any, remat: str | None = None,
             remat_names: tuple[str, ...] | None = None, **kwargs: Any) -> Any:
  """Runs a stacked NNX module layer by layer through ``scan_layers``.

  ``layers`` is one module whose every Variable has a leading layer axis, as
  made by the standard NNX scan-over-layers pattern (``nnx.vmap`` over split
  rngs). Layer ``i`` is called as ``layer_i(x, *args, **kwargs)`` and returns
  the next ``x``; ``args`` and ``kwargs`` are the same for every layer.

  Parameters (``nnx.Param``) are scanned as ``scan_layers``' ``xs`` exactly
  as they are held by ``layers``, so under an ``Engine`` each layer's are
  gathered (stage 3) or gradient-scattered (stage 2) on their own. Other
  state (``nnx.Rngs`` keys and counts of dropout, ``nnx.BatchStat``) is
  scanned alongside, one layer's slice per iteration, and its updated value
  written back into ``layers`` afterwards, as ``nnx.scan`` does. Parameters
  are read-only: a layer that assigns to its own ``nnx.Param`` loses the
  assignment.

  Example::

    class Model(nnx.Module):
      def __init__(self, d, n_layers, *, rngs):
        @nnx.vmap(in_axes=0, out_axes=0)
        def create(rngs):
          return Block(d, rngs=rngs)           # Block(x) -> x
        self.blocks = create(rngs.split(n_layers))
        self.head = nnx.Linear(d, 1, rngs=rngs)

      def __call__(self, x):
        # instead of nnx.scan(lambda x, b: b(x), in_axes=(nnx.Carry, 0),
        #                     out_axes=nnx.Carry)(x, self.blocks)
        return self.head(zj.scan_nnx(self.blocks, x))

    graphdef, params = nnx.split(model, nnx.Param)
    loss_fn = lambda p, b: jnp.mean((nnx.merge(graphdef, p)(b["x"])
                                     - b["y"]) ** 2)

  Dropout under an ``Engine(..., with_rng=True)``: split the rest of the
  state off (``graphdef, params, rest = nnx.split(model, nnx.Param, ...)``)
  and give the engine ``params`` only. In ``loss_fn(params, batch, key)``,
  ``model = nnx.merge(graphdef, params, rest, copy=True)`` (``copy=True``:
  ``rest`` is closed over, and its Variables cannot be advanced from inside
  the engine's trace; ``nnx.scan`` has the same requirement), then
  ``nnx.reseed(model, dropout=key, policy="match_shape")`` so that every
  step and device draws new masks.

  Args:
    layers: the stacked module.
    x: the initial carry (the hidden state); any pytree the layer maps to
      the same structure.
    *args: passed to every layer after ``x``.
    remat: a ``zero_jax.REMAT_POLICIES`` name; default: the engine's
      ``ZeroConfig.remat``.
    remat_names: ``checkpoint_name`` tags for the named remat policies;
      default: the engine's ``ZeroConfig.remat_names``.
    **kwargs: passed to every layer.

  Returns:
    The carry after the last layer.

  Raises:
    ValueError: ``layers`` holds no state, or some of it lacks the common
      leading layer axis (e.g. a module that was not created stacked).
  """
  graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
  _check_stacked(params, rest)

  def body(h, layer_state):
    layer_params, layer_rest = layer_state
    layer = nnx.merge(graphdef, layer_params, layer_rest)
    h = layer(h, *args, **kwargs)
    # Whatever the layer changed (rng counts, batch statistics) is this
    # layer's slice of the new non-parameter state.
    _, _, new_rest = nnx.split(layer, nnx.Param, ...)
    return h, new_rest

  h, new_rest = scan_layers(body, x, (params, rest),
                            **_remat_options(remat, remat_names))
  if jax.tree.leaves(new_rest):
    # Only when there is state to write: updating Variables from another
    # trace level is an error, and pure-parameter layers need no update.
    nnx.update(layers, new_rest)
  return h


def _remat_options(remat: str | None,
                   remat_names: tuple[str, ...] | None) -> dict[str, Any]:
  """``scan_layers`` keywords; only those given, so defaults stay its own."""
  options: dict[str, Any] = {"remat": remat}
  if remat_names is not None:
    options["remat_names"] = tuple(remat_names)
  return options


def _check_stacked(params: nnx.State, rest: nnx.State) -> None:
  """Raises unless every leaf has the same leading (layer) dimension."""
  rows = [(path, x) for state in (params, rest)
          for path, x in jax.tree_util.tree_flatten_with_path(state)[0]]
  if not rows:
    raise ValueError("scan_nnx: the module holds no state to scan over")
  length = None
  for path, x in rows:
    shape = jnp.shape(x)
    if length is None and shape:
      length = shape[0]
    if not shape or shape[0] != length:
      raise ValueError(
          f"scan_nnx needs a stacked module: every Variable with a leading "
          f"layer axis of the same length ({length}), but "
          f"{jax.tree_util.keystr(path)} has shape {shape}. Create the "
          "layers with nnx.vmap(in_axes=0, out_axes=0) over rngs.split(L).")


# -------------------------------------------------------------------- Linen


def scan_linen(block: type[nn.Module], *,
               variable_axes: Mapping[str, int] | None = None,
               split_rngs: Mapping[str, bool] | None = None,
               length: int,
               in_axes: Any = 0,
               remat: str | None = None,
               remat_names: tuple[str, ...] | None = None
               ) -> type[nn.Module]:
  """Drop-in for ``nn.scan(block, ...)`` whose layers run via ``scan_layers``.

  Replace ``nn.scan`` by ``zj.scan_linen`` in

    ``nn.scan(Block, variable_axes={"params": 0},
    split_rngs={"params": True}, length=L)``

  and construct and call the result as before: ``Block`` is
  ``__call__(self, carry, *xs) -> (carry, y)`` and the scanned module returns
  ``(carry, ys)``. ``init`` *is* ``nn.scan``'s (the returned class subclasses
  it and delegates to it while initializing), so the parameter tree, its
  ``(L, ...)`` stacked leaves and their initial values are the same as with
  ``nn.scan``, and existing checkpoints load unchanged. ``apply`` instead runs
  ``Block(...).apply({"params": layer_params}, carry, *x)`` one layer at a
  time through ``scan_layers`` over the module's own parameter arrays, so
  under an ``Engine`` each layer is gathered (stage 3) or gradient-scattered
  (stage 2) on its own.

  Example::

    class Block(nn.Module):
      d: int

      @nn.compact
      def __call__(self, h, _):
        return h + nn.Dense(self.d)(nn.LayerNorm()(h)), None

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        Blocks = zj.scan_linen(Block, variable_axes={"params": 0},
                               split_rngs={"params": True}, length=4)
        h, _ = Blocks(d=64, name="blocks")(x, None)
        return nn.Dense(1)(h)

  Args:
    block: the layer's module class (``nn.remat(Block)`` works too).
    variable_axes: as for ``nn.scan``; only ``{"params": 0}`` (the default)
      is supported: layers with other collections (``batch_stats``, caches)
      need ``nn.scan``.
    split_rngs: as for ``nn.scan`` (default ``{"params": True}``). At apply
      time each named stream other than ``"params"`` that the caller
      provides (e.g. ``"dropout"``) is passed to the layers: a different key
      per layer where True, the same key where False.
    length: the number of layers.
    in_axes: as for ``nn.scan``, per extra positional argument (or one for
      all): ``0`` (or another int) scans the argument over that axis,
      ``nn.broadcast`` passes it whole to every layer (e.g. a mask or a
      ``train`` flag). As with ``nn.scan``, the call takes no keyword
      arguments.
    remat: a ``zero_jax.REMAT_POLICIES`` name; default: the engine's
      ``ZeroConfig.remat``.
    remat_names: ``checkpoint_name`` tags for the named remat policies;
      default: the engine's ``ZeroConfig.remat_names``.

  Returns:
    A module class, constructed with ``block``'s fields (and ``name``).

  Raises:
    NotImplementedError: ``variable_axes`` other than ``{"params": 0}``.
  """
  variable_axes = dict(variable_axes or {"params": 0})
  if variable_axes != {"params": 0}:
    raise NotImplementedError(
        f"scan_linen supports variable_axes={{'params': 0}} only, got "
        f"{variable_axes}; scan layers with other collections (batch_stats, "
        "cache) with nn.scan")
  split_rngs = dict(split_rngs or {"params": True})
  base = nn.scan(block, variable_axes=variable_axes, split_rngs=split_rngs,
                 length=length, in_axes=in_axes)
  block_fields = [f.name for f in dataclasses.fields(block)
                  if f.init and f.name not in ("parent", "name")]

  class _ZeroScanned(base):  # type: ignore[misc, valid-type]

    def __call__(self, carry, *xs):
      if self.is_initializing():
        # nn.scan's own init: identical parameter layout and values.
        return super().__call__(carry, *xs)
      others = set(self.variables) - {"params"}
      if others:
        raise NotImplementedError(
            f"scan_linen layers may hold only 'params'; got collections "
            f"{sorted(others)}")
      # The very arrays apply() was given: scan_layers recognises them.
      params = self.variables["params"]
      template = block(**{n: getattr(self, n) for n in block_fields},
                       parent=None)
      axes = (tuple(in_axes) if isinstance(in_axes, (tuple, list)) else
              (in_axes,) * len(xs))
      if len(axes) != len(xs):
        raise ValueError(f"in_axes has {len(axes)} entries for {len(xs)} "
                         "scanned arguments")
      scanned = [None if ax is nn.broadcast else x if ax == 0 else
                 jax.tree.map(lambda a, ax=ax: jnp.moveaxis(a, ax, 0), x)
                 for x, ax in zip(xs, axes)]
      split_keys, same_keys = {}, {}
      for name, split in split_rngs.items():
        if name != "params" and self.has_rng(name):
          key = self.make_rng(name)
          if split:
            split_keys[name] = jax.random.split(key, length)
          else:
            same_keys[name] = key

      def body(h, layer):
        layer_params, layer_xs, layer_keys = layer
        args = [x if ax is nn.broadcast else lx
                for x, ax, lx in zip(xs, axes, layer_xs)]
        return template.apply({"params": layer_params}, h, *args,
                              rngs={**same_keys, **layer_keys})

      return scan_layers(body, carry, (params, scanned, split_keys),
                         **_remat_options(remat, remat_names))

  # Auto-naming (ScanBlock_0) and reprs as with nn.scan.
  _ZeroScanned.__name__ = base.__name__
  _ZeroScanned.__qualname__ = base.__qualname__
  return _ZeroScanned
