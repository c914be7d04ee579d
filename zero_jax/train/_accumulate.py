"""Micro-batches of a loss of global meaning (``loss_scope="global"``,
``grad_accum_steps > 1``): how the global batch is cut, how the
micro-batches' losses and gradients are weighed, and the first step's check
that the weighed combination is the whole batch's loss.

A loss that is not an equal-weight mean of per-example terms does not split
into micro-batches by averaging. A masked token mean splits exactly when
each micro-batch weighs its count of valid tokens (``Engine(loss_weight=)``,
the global count taken before the first micro-batch, as HuggingFace's
``num_items_in_batch``); an in-batch contrastive loss or a batch statistic
does not split at all. Nothing in a loss's code says which, so the first
step compares, once, the combination with ``loss_fn`` on the whole batch,
and refuses a loss for which they differ.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zero_jax.config import Accumulation
from zero_jax.layout import Decisions

if TYPE_CHECKING:  # (the plan's module imports this one)
  from zero_jax.train._step_plan import StepPlan

# How far (relative) the micro-batches' weighed loss may land from the
# whole batch's in the first step's float32 check: reduction order moves a
# float32 mean by ~1e-7; a masked mean weighed equally, in-batch negatives
# or a batch statistic move it by 1e-4 and more.
SPLIT_RTOL = 1e-5

_MEAN = Accumulation.MEAN_OF_MICRO_BATCHES


@dataclasses.dataclass(frozen=True)
class Split:
  """How one step's global batch is cut into micro-batches.

  Micro-batch ``i`` is the ``i``-th block of rows of every device's slice,
  so each stays spread over all devices and the cut moves nothing.

  Attributes:
    steps: micro-batches per step.
    devices: devices the batch is split over.
    sharding: the batch's ``NamedSharding``.
    weight: ``Engine(loss_weight=)``: a micro-batch's weight from its rows
      (None: each weighs the same).
  """

  steps: int
  devices: int
  sharding: NamedSharding
  weight: Callable[[Any], Any] | None

  @classmethod
  def of(cls, layout: StepPlan, loss: Any) -> "Split":
    """The split of ``layout``'s batch for the engine's ``loss``."""
    return cls(layout.batch.grad_accum_steps, layout.batch.num_devices,
               layout.batch.sharding, loss.weight)

  def micro_batches(self, batch: Any) -> Any:
    """``batch`` with a leading axis of ``steps`` micro-batches, each laid
    out as the batch is."""
    spec = self.sharding.spec
    stacked = NamedSharding(self.sharding.mesh, P(None, *spec))

    def cut(x):
      rows = x.shape[0] // (self.devices * self.steps)
      x = x.reshape(self.devices, self.steps, rows, *x.shape[1:])
      x = jnp.swapaxes(x, 0, 1).reshape(self.steps, self.devices * rows,
                                        *x.shape[3:])
      return jax.lax.with_sharding_constraint(x, stacked)

    return jax.tree.map(cut, batch)

  def weights(self, micro: Any) -> jax.Array:
    """Each micro-batch's float32 weight (``steps``,)."""
    if self.weight is None:
      return jnp.ones((self.steps,), jnp.float32)
    return jax.lax.map(
        lambda b: jnp.asarray(self.weight(b), jnp.float32).reshape(()),
        micro)


def combine(weights: jax.Array, values: Any) -> Any:
  """The weighed mean over micro-batches (leading axis) of each leaf of
  ``values``; a micro-batch of weight 0 counts for nothing, even where its
  own value is NaN (a masked mean of no valid token)."""
  total = jnp.sum(weights)

  def mean(v):
    w = weights.reshape((-1,) + (1,) * (v.ndim - 1))
    return jnp.sum(jnp.where(w > 0, v * w, 0), axis=0) / total

  return jax.tree.map(mean, values)


def add(acc: Any, grads: Any, weight: jax.Array, total: jax.Array) -> Any:
  """``acc`` plus one micro-batch's gradients at its share of the weight.
  A weight-0 micro-batch adds nothing, NaN gradients included (selected,
  not multiplied)."""
  share = weight / total
  return jax.tree.map(
      lambda a, g: a + jnp.where(weight > 0, g.astype(jnp.float32) * share,
                                 0), acc, grads)


def finish(acc: Any, total: jax.Array) -> Any:
  """The accumulated gradients; NaN where no micro-batch weighed anything,
  as one device's gradient of a mean over nothing is (so the step is
  skipped as a non-finite one)."""
  return jax.tree.map(lambda a: a * jnp.where(total > 0, 1.0, jnp.nan), acc)


def check_loss(decisions: Decisions, loss: Any, steps: int) -> None:
  """Raises where the engine's loss and config cannot make the step the
  config asks for: ``loss_weight`` where it weighs nothing, or a random
  loss whose split cannot be checked.

  Args:
    decisions: the engine's ``Decisions``.
    loss: the engine's ``_grads.Loss``.
    steps: micro-batches per step.
  """
  if loss.weight is not None and not decisions.global_loss:
    raise ValueError(
        "Engine(loss_weight=...) weighs the micro-batches of a loss of "
        "global meaning; with loss_scope='per_device' each device's loss "
        "weighs the same: set ZeroConfig(loss_scope='global'), or drop "
        "loss_weight.")
  if (loss.weight is not None and
      decisions.accumulation is _MEAN):
    raise ValueError(
        "Engine(loss_weight=...) weighs micro-batches to train the whole "
        "batch's loss, but ZeroConfig.accumulation='mean_of_micro_batches' "
        "asks for each micro-batch to weigh the same: drop one of them.")
  if (decisions.global_loss and steps > 1 and loss.with_rng and
      loss.weight is None and decisions.accumulation is not _MEAN):
    raise ValueError(
        f"a with_rng loss over grad_accum_steps={steps} micro-batches "
        "cannot be checked against the whole batch's loss (its random "
        "draws differ by shape): say how it splits with Engine(loss_weight="
        "lambda batch: ...) (each micro-batch's count, e.g. "
        "batch['mask'].sum(); lambda batch: 1.0 for a per-example mean), "
        "or set ZeroConfig(accumulation='mean_of_micro_batches') "
        "(DeepSpeed's meaning), or grad_accum_steps=1.")


def needs_check(decisions: Decisions, loss: Any, steps: int) -> bool:
  """Whether the first step checks the split (``check_split``)."""
  return (decisions.global_loss and steps > 1 and
          decisions.accumulation is not _MEAN and
          not loss.with_rng)


def check_split(split: Split, loss_of: Callable[[Any, Any], jax.Array],
                params: Any, batch: Any) -> None:
  """Raises unless the micro-batches' weighed loss is the whole batch's.

  Args:
    split: the step's ``Split``.
    loss_of: ``loss_of(params, batch) -> loss``, the engine's loss as the
      step calls it (its aux dropped).
    params: what forward reads; evaluated in float32.
    batch: the first step's global batch, laid out.

  Raises:
    ValueError: they differ by more than ``SPLIT_RTOL``; the message gives
      both values and the fixes.
  """
  def both(params, batch):
    # (On the device, where offload_params keeps them in host memory.)
    params = jax.tree.map(
        lambda x: jax.device_put(x, jax.memory.Space.Device).astype(
            jnp.float32), params)
    micro = split.micro_batches(batch)
    values = jax.lax.map(lambda b: loss_of(params, b), micro)
    return (loss_of(params, batch),
            combine(split.weights(micro), values), values)

  whole, combined, values = jax.device_get(jax.jit(both)(params, batch))
  whole, combined = float(whole), float(combined)
  if np.isnan(whole) and np.isnan(combined):
    return  # (a batch of nothing, on one device too)
  scale = max(abs(whole), float(np.max(np.abs(values))), 1e-30)
  if abs(whole - combined) <= SPLIT_RTOL * scale:
    return
  how = ("weighed by loss_weight" if split.weight is not None else
         "each weighing the same")
  raise ValueError(
      f"loss_fn does not split into grad_accum_steps={split.steps} "
      f"micro-batches: on the first step's batch (in float32) it is "
      f"{whole:.8g} over the whole batch but {combined:.8g} as its "
      f"micro-batches' losses {how} (micro-batch losses "
      f"{np.array2string(np.asarray(values), precision=6)}). Training "
      "would not be the whole batch's loss. For a masked or padded mean, "
      "pass Engine(loss_weight=lambda batch: <its count of valid tokens>, "
      "e.g. batch['mask'].sum()); a loss that reads the whole batch "
      "(in-batch negatives, batch statistics) needs grad_accum_steps=1 "
      "(a smaller model or remat to fit it); or set ZeroConfig("
      "accumulation='mean_of_micro_batches') for DeepSpeed's meaning, "
      "each micro-batch's loss weighing the same.")


def describe(decisions: Decisions, loss: Any, steps: int) -> str | None:
  """``Engine.describe``'s line on how a global loss's micro-batches make
  the step (None with one micro-batch or a per-device loss)."""
  if not decisions.global_loss or steps == 1:
    return None
  if decisions.accumulation is _MEAN:
    return (f"accumulation: the mean of {steps} micro-batches' losses, each "
            "weighing the same (DeepSpeed's meaning)")
  how = ("weighed by loss_weight" if loss.weight is not None else
         "weighing the same")
  checked = ("not checked (a with_rng loss)" if loss.with_rng else
             "checked against the whole batch's at the first step")
  return (f"accumulation: the whole batch's loss from {steps} micro-batches "
          f"{how}, {checked}")
