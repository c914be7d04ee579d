"""The GSPMD FSDP peer of a ZeRO step, compiled: what ZeRO is held against.

``compile_gspmd_step`` compiles a MaxText-style GSPMD FSDP step: one plain
``jax.jit`` of a loss, its gradient and an optax update, with the
parameters and optimizer state laid out as ZeRO-3 lays them out and every
collective left to XLA. (The reference GPT's, ``compile_gspmd_gpt``, is
``zero_jax.models``'.)
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from zero_jax.analysis import _aot as aot
from zero_jax.analysis import _hlo as hlo
from zero_jax.analysis import _measure as measure
from zero_jax.analysis import _transfers as transfers_
from zero_jax.config import ZeroConfig
from zero_jax.layout import DATA, Plan
from zero_jax.layout._mesh import layout_mesh


def compile_gspmd_step(loss_fn: Any, tx: Any, params: Any, batch: Any,
                       mesh: jax.sharding.Mesh, *,
                       min_shard_elements: int | None = None
                       ) -> tuple[Any, aot.CompiledStep]:
  """Compiles one plain ``jax.jit`` train step laid out like ZeRO-3, every
  collective left to GSPMD (FSDP as MaxText and ``jax.jit`` users write it).

  Parameters and every optimizer-state leaf are split over ``data`` on
  their largest divisible dimension by ``zero_jax.layout.Plan`` at stage 3
  with the engine's threshold (the same layout as the engine's stage-3
  state), the batch on its leading dimension. The step is
  ``value_and_grad`` + ``tx.update`` + ``apply_updates``, parameters and
  optimizer state donated. Nothing is materialised: it is lowered from
  shapes and shardings, on real devices or compile-only GPUs
  (``gpu_mesh``).

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` (e.g.
      ``pinned_gpt_loss``).
    tx: the optax optimizer.
    params: the parameters, or their shapes.
    batch: the global batch, or its shapes.
    mesh: a one-axis ``data`` mesh.
    min_shard_elements: leaves smaller than this stay replicated; None:
      ``ZeroConfig``'s default, as the engine does.

  Returns:
    ``(state, compiled)``: ``state`` is ``(params, opt_state)`` as
    ``jax.ShapeDtypeStruct`` with their shardings (``per_device_bytes``
    measures them) and ``compiled`` the ``CompiledStep``.
  """
  import optax  # pylint: disable=g-import-not-at-top
  if min_shard_elements is None:
    min_shard_elements = ZeroConfig().min_shard_elements
  abstract = lambda tree, shardings: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      tree, shardings)
  param_sh = Plan(params, mesh, 3, min_shard_elements).shardings
  opt_shapes = jax.eval_shape(tx.init, params)
  opt_sh = Plan(opt_shapes, mesh, 3, min_shard_elements).shardings
  batch_sh = jax.tree.map(
      lambda _: NamedSharding(layout_mesh(mesh), P(DATA)), batch)

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  jitted = jax.jit(step, in_shardings=(param_sh, opt_sh, batch_sh),
                   out_shardings=(param_sh, opt_sh,
                                  NamedSharding(layout_mesh(mesh), P())),
                   donate_argnums=(0, 1))
  state = (abstract(params, param_sh), abstract(opt_shapes, opt_sh))
  with jax.set_mesh(mesh):
    compiled = jitted.lower(*state, abstract(batch, batch_sh)).compile()
  text = compiled.as_text()
  return state, aot.CompiledStep(
      memory=measure.compiled_memory(compiled),
      collectives=hlo.summarize_by_dtype(text), hlo=text,
      params=measure.param_count(params),
      transfers=transfers_.host_transfers(text))
