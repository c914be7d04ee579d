"""The sections of ``ZeroConfig`` that group related fields, each a frozen
dataclass checked on construction (Levanter's nested configs), and the
string enums their choices are made of.

A section checks its own fields and the rules between them; the rules
between sections are ``zero_jax.config._combinations``'. Each field's
errors name it in full, with the flat shorthand ``ZeroConfig`` also takes:
``ZeroConfig.precision.compute (compute_dtype)``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Callable, Mapping, NoReturn

import jax.numpy as jnp
import numpy as np

from zero_jax._checks import check_bool, check_choice, check_float, check_int
from zero_jax._checks import fail as _raise

# Counters the loss scaler and the skip logic keep on the device are int32.
INT32_MAX = int(np.iinfo(np.int32).max)
# The loss scale lives in float32: 2.0**128 is already inf there, and an
# infinite scale overflows every step, so every step would be skipped.
_MAX_SCALE_POWER = int(math.floor(math.log2(np.finfo(np.float32).max)))
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_DTYPES = ("bfloat16", "float16", "float32")
# Spellings people write for the dtypes (PyTorch's, DeepSpeed's, mixed
# precision's), each read as the dtype it names.
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "fp32": "float32", "float": "float32"}


class ConfigEnum(str, enum.Enum):
  """A choice of a config field: equal to its string (``"host" ==
  Tier.HOST``), and printed as it, so that configs written with strings
  read the same."""

  def __str__(self) -> str:
    return self.value

  def __repr__(self) -> str:
    return repr(self.value)


class Tier(ConfigEnum):
  """Where offloaded state lives between steps (None: on the device)."""

  HOST = "host"  # host RAM
  NVME = "nvme"  # files on a local disk (the optimizer state only)


class UpdateOn(ConfigEnum):
  """Where the optimizer update of offloaded state runs."""

  DEVICE = "device"  # streamed through the device a slice at a time
  HOST = "host"  # on the host's CPUs (ZeRO-Offload's split)


class LossScope(ConfigEnum):
  """What ``loss_fn``'s value means."""

  GLOBAL = "global"  # one device's, given the whole global batch
  PER_DEVICE = "per_device"  # averaged over the devices' slices


class Accumulation(ConfigEnum):
  """What a step of several micro-batches trains."""

  WHOLE_BATCH = "whole_batch"
  MEAN_OF_MICRO_BATCHES = "mean_of_micro_batches"


class Section:
  """Field checks shared by the sections: each sets the field to its
  checked, normalized value (numpy scalars become Python ones, so that
  equal configs hash alike)."""

  # The ZeroConfig attribute the section is kept in.
  NAME = ""
  # Its fields' flat shorthand names in ZeroConfig, by field.
  SHORTHAND: dict[str, str] = {}

  def _label(self, name: str) -> str:
    """The field's full name for messages, with its shorthand."""
    flat = self.SHORTHAND.get(name)
    return (f"ZeroConfig.{self.NAME}.{name}"
            + (f" ({flat})" if flat and flat != name else ""))

  def _set(self, name: str, value: Any) -> None:
    object.__setattr__(self, name, value)  # (the dataclass is frozen)

  def _check(self, name: str, check: Callable[..., Any], *args: Any,
            **kwargs: Any) -> None:
    """Sets field ``name`` to ``check(<its label>, <value>, ...)``."""
    self._set(name, check(self._label(name), getattr(self, name), *args,
                         **kwargs))

  def _fail(self, name: str, what: str, fix: str,
           value: Any = dataclasses.MISSING) -> NoReturn:
    """Raises the error of a field whose value is not ``what``."""
    _raise(self._label(name), what,
           getattr(self, name) if value is dataclasses.MISSING else value,
           fix)


def from_mapping(kind: type, value: Mapping[str, Any], what: str,
                 **overrides: Any) -> Any:
  """``kind(**value, **overrides)``, refusing keys that are not fields of
  the dataclass ``kind`` (``what`` names it in the message)."""
  names = {f.name for f in dataclasses.fields(kind)}
  unknown = sorted(set(value) - names)
  if unknown:
    raise ValueError(f"unknown {what} field(s) {unknown}; valid fields are "
                     f"{sorted(names)}")
  return kind(**{**value, **overrides})


@dataclasses.dataclass(frozen=True)
class MixedPrecision(Section):
  """The dtypes of compute and of gradient sums.

  Attributes:
    compute: dtype of forward/backward and of the communicated
      parameters (``"bfloat16"``, ``"float16"``, or their short names
      ``"bf16"``, ``"fp16"``, ``"half"``; None: float32 throughout).
      Master parameters and optimizer state stay float32; at stages 1-2 a
      compute-dtype copy of the parameters is kept for forward: replicated,
      and refreshed by an all-gather in the compute dtype after each update
      (stage 1; stage 2 with ``prefetch=False``, offload or accumulation);
      at stage 2 by default (``prefetch``) there is none: forward gathers
      the master's shards in the compute dtype, layer by layer.
    reduce: dtype gradients are summed in across devices. None (the
      default): with ``loss_scope="global"``, the compute dtype (the
      compiler sums each gradient where its matmul leaves it, as plain
      ``jax.jit``, FSDP and DeepSpeed do by default); with
      ``"per_device"``, float32 whatever the compute dtype. Its sharded
      leaf's 16-bit gradient still crosses in 16 bits: an all-to-all hands
      each device every device's blocks of its shard, summed there in
      float32 (``zero_jax.materialize``), so exact sums cost a bf16
      reduce-scatter's bytes. ``"bfloat16"`` sums in bf16 by a
      reduce-scatter. With the update on the host a 16-bit ``reduce``
      also halves the gradients' bytes to the host (ZeRO-Offload's 16-bit
      gradients): they cross in it wherever one reduction made them. At
      stage 3, a ``scan_layers`` layer's summed shard then waits for the
      update rounded to a 16-bit ``compute``, as single-device mixed
      precision's gemms give it (half the bytes of the stack).
  """

  NAME = "precision"
  SHORTHAND = {"compute": "compute_dtype", "reduce": "reduce_dtype"}

  compute: str | None = None
  reduce: str | None = None

  def __post_init__(self):
    self._check_dtype("compute", "None keeps float32 throughout.")
    self._check_dtype("reduce", "None keeps float32 sums; 'bfloat16' sums "
                      "in bf16.")

  def _check_dtype(self, name: str, fix: str) -> None:
    """Sets ``name`` to the canonical name of its dtype, or None."""
    value = getattr(self, name)
    if value is None:
      return
    if isinstance(value, str):
      value = _DTYPE_ALIASES.get(value, value)
    try:
      canonical = jnp.dtype(value).name
    except (TypeError, ValueError):
      canonical = None
    if canonical not in _DTYPES:
      self._fail(name, f"None or one of {_DTYPES} (or bf16, fp16, half)",
                 fix)
    self._set(name, canonical)


@dataclasses.dataclass(frozen=True)
class LossScaling(Section):
  """float16's loss scaling, by DeepSpeed's rules (``compute="float16"``
  only). A step whose gradients hold an inf or nan on any device is
  skipped on all devices.

  Attributes:
    scale: 0 (the default): dynamic loss scaling; > 0: this static scale.
    initial_power: dynamic scaling starts at 2**this; at most 127, as the
      scale is float32 (2**128 is inf there).
    window: clean steps after which the dynamic scale doubles.
    hysteresis: overflows tolerated before the scale halves (DeepSpeed's
      ``delayed_shift``; reset when the scale doubles).
    min_scale: the dynamic scale never goes below this; an overflow at
      this scale is an error (training has diverged).
    consecutive_hysteresis: refill the hysteresis on every clean step
      rather than only when the scale doubles.
  """

  NAME = "loss_scaling"
  SHORTHAND = {"scale": "loss_scale", "initial_power": "initial_scale_power",
               "window": "loss_scale_window", "hysteresis": "hysteresis",
               "min_scale": "min_loss_scale",
               "consecutive_hysteresis": "consecutive_hysteresis"}

  scale: float = 0.0
  initial_power: int = 16
  window: int = 1000
  hysteresis: int = 2
  min_scale: float = 1.0
  consecutive_hysteresis: bool = False

  def __post_init__(self):
    self._check("scale", check_float, 0.0, maximum=_FLOAT32_MAX,
               what="0 (dynamic) or a finite number > 0 (static) that fits "
               "in float32", fix="use 0 for dynamic loss scaling, or a "
               "power of two such as 1024.0 for a static scale.")
    self._check("initial_power", check_int, 0, _MAX_SCALE_POWER,
               fix=(f"the loss scale 2**power is kept in float32, where 2**"
                    f"{_MAX_SCALE_POWER + 1} and above are inf (every step "
                    f"would overflow and be skipped); the largest allowed "
                    f"power is {_MAX_SCALE_POWER} (DeepSpeed's default is "
                    f"16)."))
    self._check("window", check_int, 1, INT32_MAX,
               fix="it counts the clean steps before the dynamic scale "
               "doubles (DeepSpeed's default is 1000).")
    self._check("hysteresis", check_int, 1, INT32_MAX,
               fix="it counts the overflows tolerated before the scale "
               "halves (DeepSpeed's default is 2; 1 halves at once).")
    max_scale = 2.0 ** self.initial_power
    self._check("min_scale", check_float, 0.0, strict=True, maximum=max_scale,
               what=f"> 0 and at most the initial scale 2**"
               f"{self.initial_power} = {max_scale:g}",
               fix="lower min_loss_scale (the default is 1.0), or raise "
               "initial_scale_power.")
    self._check("consecutive_hysteresis", check_bool,
               "True refills the hysteresis on every clean step.")


@dataclasses.dataclass(frozen=True)
class ZeroPP(Section):
  """ZeRO++ (arXiv:2306.10209): quantized collectives and hpZ.

  Attributes:
    quantized_weights: qwZ (DeepSpeed's ``zero_quantized_weights``),
      stage 3 only: parameters are all-gathered as int8 blocks of 256
      elements, each with a float32 scale (about 0.51x the bytes of a bf16
      gather), made from the float32 master shard and dequantized to the
      compute dtype at use. Approximate: each gathered element is off by at
      most half its block's ``max |w| / 127``; gradients are taken as if
      the gather were exact.
    quantized_gradients: qgZ (DeepSpeed's ``zero_quantized_gradients``),
      stages 1-3: each sharded gradient crosses as int8 blocks of 256
      elements with float32 scales, by an all-to-all, and every device
      dequantizes the blocks of its own shard and sums them in float32
      (about 0.26x the bytes of a float32 reduce-scatter). Approximate:
      each device's contribution is off by at most half its block's ``max
      |g| / 127``. Replicated leaves (below ``min_shard_elements``) are
      still all-reduced exactly. Not with ``loss_scope="global"``.
    hpz_partition_size: hpZ (DeepSpeed's ``zero_hpz_partition_size``),
      stage 3 only; 1 (default) is off. K > 1: the devices of a mesh
      ``make_mesh(replica=R)`` whose ``data`` axis is K (one group of K
      devices per node). The fp32 master, optimizer state and gradients
      stay sharded over all ``R * K`` devices, and each layer is gathered
      across the groups once in forward, into a 16-bit secondary copy
      sharded over its group (1/K of the parameters per device, kept for
      backward); backward's gathers read that copy and never leave the
      group. Exact (the same float32 sums: over the group, then across
      groups). Not with offload, prefetch or a ``model`` axis. With
      ``loss_scope="global"`` sharding constraints place the same two
      gathers, and each layer's gradient is summed over the group, then
      across groups, in the reduce dtype.
  """

  NAME = "zeropp"
  SHORTHAND = {"quantized_weights": "quantized_weights",
               "quantized_gradients": "quantized_gradients",
               "hpz_partition_size": "hpz_partition_size"}

  quantized_weights: bool = False
  quantized_gradients: bool = False
  hpz_partition_size: int = 1

  def __post_init__(self):
    self._check("quantized_weights", check_bool,
               "True (stage 3) gathers the parameters as int8 blocks "
               "(ZeRO++'s qwZ).")
    self._check("quantized_gradients", check_bool,
               "True (stages 1-3) sums the gradients from int8 blocks "
               "(ZeRO++'s qgZ).")
    self._check("hpz_partition_size", check_int, 1, INT32_MAX,
               fix="it is the devices per hpZ group (one node), the "
               "'data' axis of make_mesh(replica=devices // size); 1 "
               "turns hpZ off.")


@dataclasses.dataclass(frozen=True)
class Batch(Section):
  """Batch sizes, by DeepSpeed's rule ``global_size = micro_size *
  accum_steps * devices`` (``ZeroConfig.batch_sizes``), and what a step
  of several micro-batches trains.

  Attributes:
    global_size: global batch per step (all devices, all micro-batches);
      ``step`` rejects any other. Optional.
    micro_size: examples per device per micro-batch (DeepSpeed's
      ``train_micro_batch_size_per_gpu``). Optional.
    accum_steps: micro-batches per step, run by a scan inside the jitted
      step. None: 1, or derived from the batch sizes. Stages 0-1
      accumulate each device's full gradient and reduce it once; stages
      2-3 reduce every micro-batch's gradient and accumulate the shard.
    accumulation: what a step of several micro-batches trains. None: the
      loss scope's own meaning (``"whole_batch"`` with a global loss; the
      mean over devices and micro-batches with a per-device one).
      ``"whole_batch"`` (global loss only): ``loss_fn`` on the whole
      global batch, as one device. The micro-batches' losses are combined
      with the weights of ``Engine(loss_weight=...)`` (equal without
      one), and the first step checks once, in float32, that the
      combination equals the whole batch's loss; a loss that does not
      split so (a masked mean without its weight, in-batch negatives,
      batch statistics) is refused there with the fix. A ``with_rng``
      loss, whose random draws differ by shape, cannot be compared and
      needs ``loss_weight``. ``"mean_of_micro_batches"``: DeepSpeed's
      meaning, each micro-batch's loss weighing the same, unchecked
      (``loss_weight`` is refused with it, and with a per-device loss).
  """

  NAME = "batch"
  SHORTHAND = {"global_size": "train_batch_size",
               "micro_size": "micro_batch_size",
               "accum_steps": "grad_accum_steps",
               "accumulation": "accumulation"}

  global_size: int | None = None
  micro_size: int | None = None
  accum_steps: int | None = None
  accumulation: Accumulation | None = None

  def __post_init__(self):
    for name, fix in (
        ("accum_steps", "None runs one micro-batch per step, or derives "
         "the count from the batch sizes."),
        ("global_size", "None leaves the global batch free."),
        ("micro_size", "None leaves the per-device batch free.")):
      self._check(name, check_int, 1, optional=True, fix=fix)
    self._check("accumulation", check_choice,
               (None,) + tuple(a.value for a in Accumulation),
               "None follows loss_scope; 'whole_batch' (loss_scope="
               "'global') trains the whole batch's loss, checked; "
               "'mean_of_micro_batches' averages the micro-batches' "
               "losses (DeepSpeed's meaning).")
    if self.accumulation is not None:
      self._set("accumulation", Accumulation(self.accumulation))
