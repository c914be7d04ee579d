"""ZeRO configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, NoReturn

import jax.numpy as jnp
import numpy as np

from zero_jax._checks import (check_bool, check_choice, check_float,
                              check_int, fail)
from zero_jax.config._batch_sizes import resolve_batch_sizes
from zero_jax.config._combinations import check_combinations
from zero_jax.config._nvme import NvmeOptions, offload_fields
from zero_jax.config._remat import REMAT_POLICIES, RematPolicy, check_remat

# The ZeRO stages: 0 (plain data parallelism) to 3.
STAGES = (0, 1, 2, 3)
# What loss_fn's value means (ZeroConfig.loss_scope).
LOSS_SCOPES = ("per_device", "global")
# How a step's micro-batches make its loss (ZeroConfig.accumulation).
ACCUMULATIONS = (None, "whole_batch", "mean_of_micro_batches")
_COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
# Counters the loss scaler and the skip logic keep on the device are int32.
_INT32_MAX = int(np.iinfo(np.int32).max)
# jax.random.PRNGKey takes a seed that fits in int64.
_INT64 = (int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max))
# The loss scale lives in float32: 2.0**128 is already inf there, and an
# infinite scale overflows every step, so every step would be skipped.
_MAX_SCALE_POWER = int(math.floor(math.log2(np.finfo(np.float32).max)))
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
  """How a model is laid out and trained over the ``data`` axis of a mesh.

  Attributes:
    stage: ZeRO stage. 0: plain data parallelism (everything replicated,
      gradients all-reduced). 1: optimizer state and fp32 master weights
      sharded, gradients reduce-scattered after backward. 2: as 1, but each
      gradient leaf is reduce-scattered as soon as backward produces it.
      3: parameters sharded too and all-gathered where they are used.
    min_shard_elements: leaves with fewer elements than this are replicated
      rather than sharded (the gather would cost more than the memory saved;
      DeepSpeed calls this ``stage3_param_persistence_threshold``). Every such
      leaf is listed by ``Engine.describe()``.
    seed: seed of the per-step, per-device PRNG key handed to ``loss_fn``
      when the engine is built with ``with_rng=True``.
    remat: rematerialization policy of each layer run by
      ``zero_jax.scan_layers`` (see ``REMAT_POLICIES``): ``"full"`` (save
      nothing, recompute the layer and re-gather its parameters in backward;
      the default), ``"none"`` (keep everything, including stage 3's gathered
      parameters), ``"dots_saveable"`` (keep matmul outputs, not gathered
      parameters), ``"attention_saveable"`` (keep cuDNN flash attention's
      outputs and statistics), ``"dots_attention_saveable"`` (both),
      ``"save_only_named"`` (keep the activations tagged with
      ``zero_jax.checkpoint_name`` for a name in ``remat_names``),
      ``"offload_to_host"`` (move those to host memory until backward) or
      ``"auto"`` (the fastest that fits the device, chosen when the step
      is first compiled). Held as a ``RematPolicy``, which equals its name.
    remat_names: the ``checkpoint_name`` tags the named policies act on.
      ``zero_jax.scan_layers`` tags each layer's input ``"layer_input"``:
      ``remat="offload_to_host"`` with ``remat_names=("layer_input",)``
      keeps the layer inputs (what ``"full"`` saves) in host memory, like
      DeepSpeed's ``cpu_checkpointing``.
    partition_activations: ZeRO-R's Pa. With a ``model`` axis (tensor
      parallelism), each layer input that ``zero_jax.scan_layers`` saves
      for backward is stored split over ``model`` along the sequence
      (dimension 1 of a ``(batch, sequence, ...)`` carry) and gathered when
      backward needs it: 1/M of the bytes per device. With
      ``remat="offload_to_host"`` and ``"layer_input"`` among
      ``remat_names`` (Pa+cpu) the split inputs go to host memory. Without
      a ``model`` axis the layer inputs are already split over ``data``
      with the batch, and there is nothing more to split (as in DeepSpeed
      with one model-parallel rank); ``Engine.describe()`` says so.
    device_memory_bytes: the memory per device ``remat="auto"`` fits the
      compiled step into (None: what the device reports).
    layer_classes: the blocks run one at a time (a block's parameters
      gathered at its call and in its remat'd backward at stage 3, its
      gradients reduce-scattered as backward leaves it at stages 2-3) when
      called in a Python loop (``zero_jax.layers``): None (the default)
      finds them, as sibling Flax modules with identical parameter shapes;
      a tuple of class names (Accelerate's wrap policy) names them; ``()``
      turns it off. Scanned layers (``scan_layers``) are per layer anyway.
    compute_dtype: dtype of forward/backward and of the communicated
      parameters (``"bfloat16"``, ``"float16"``; None: float32 throughout).
      Master parameters and optimizer state stay float32; at stages 1-2 a
      compute-dtype copy of the parameters is kept for forward: replicated,
      and refreshed by an all-gather in the compute dtype after each update
      (stage 1; stage 2 with ``prefetch=False``, offload or accumulation);
      at stage 2 by default (``prefetch``) there is none: forward gathers
      the master's shards in the compute dtype, layer by layer.
    reduce_dtype: dtype gradients are summed in across devices. None (the
      default): with ``loss_scope="global"``, the compute dtype (the
      compiler sums each gradient where its matmul leaves it, as plain
      ``jax.jit``, FSDP and DeepSpeed do by default); with
      ``"per_device"``, float32 whatever the compute dtype. Its sharded
      leaf's 16-bit gradient still crosses in 16 bits: an all-to-all hands
      each device every device's blocks of its shard, summed there in
      float32 (``zero_jax.materialize``), so exact sums cost a bf16
      reduce-scatter's bytes. ``"bfloat16"`` sums in bf16 by a
      reduce-scatter. With ``update_on="host"`` a 16-bit ``reduce_dtype`` also
      halves the gradients' bytes to the host (ZeRO-Offload's 16-bit
      gradients): they cross in it wherever one reduction made them.
      At stage 3, a ``scan_layers`` layer's summed shard then waits for
      the update rounded to a 16-bit ``compute_dtype``, as single-device
      mixed precision's gemms give it (half the bytes of the stack).
    grad_accum_steps: micro-batches per step, run by a scan inside the
      jitted step. None: 1, or derived from the batch sizes below by
      DeepSpeed's rule. Stages 0-1 accumulate each device's full gradient
      and reduce it once; stages 2-3 reduce every micro-batch's gradient
      and accumulate the shard.
    train_batch_size: global batch per step (all devices, all
      micro-batches); ``step`` rejects any other. Optional.
    micro_batch_size: examples per device per micro-batch (DeepSpeed's
      ``train_micro_batch_size_per_gpu``). Optional; see ``batch_sizes``.
    clip_grad_norm: clip gradients to this global norm over the whole model
      (optax's ``clip_by_global_norm`` semantics), computed exactly across
      every shard. None: no clipping. The pre-clip norm is always reported
      as the ``grad_norm`` metric.
    loss_scale: float16 compute only. 0 (the default): dynamic loss scaling
      with DeepSpeed's rules (below); > 0: this static scale. A step whose
      gradients hold an inf or nan on any device is skipped on all devices.
    initial_scale_power: dynamic scaling starts at 2**this; at most 127,
      as the scale is float32 (2**128 is inf there).
    loss_scale_window: clean steps after which the dynamic scale doubles.
    hysteresis: overflows tolerated before the scale halves (DeepSpeed's
      ``delayed_shift``; reset when the scale doubles).
    min_loss_scale: the dynamic scale never goes below this; an overflow at
      this scale is an error (training has diverged).
    consecutive_hysteresis: refill the hysteresis on every clean step
      rather than only when the scale doubles.
    offload_optimizer: ``"host"`` keeps the optimizer state in pinned host
      memory between steps, and the fp32 master parameters too wherever
      forward reads a separate compute-dtype copy (stages 1-2 with a
      ``compute_dtype``; stage 3 with a ``compute_dtype`` keeps a sharded
      compute copy on the device for that). None keeps both on the device.
      ``"nvme"`` (ZeRO-Infinity; with ``update_on="host"`` and an optimizer
      of ``zero_jax.offload``) keeps the fp32 master and the optimizer state
      in files under ``nvme_path``, read, updated and written a slice at a
      time, and crash-consistent: docs/offload.md.
    nvme_path: with ``offload_optimizer="nvme"``, the directory (on a fast
      local disk) under which each process keeps its files.
    nvme: the NVMe tier's ``NvmeOptions`` (slices, RAM budget, I/O).
    offload_params: stage 3 only. ``"host"`` keeps the fp32 master shards in
      pinned host memory; forward and backward copy each layer's shards to
      the device just before gathering them (inside ``scan_layers``).
      At stage 3, whenever forward gathers from something other than the
      device master (this option, or ``offload_optimizer`` with a
      ``compute_dtype``) and there is one micro-batch per step, the
      gradient shards of the leaves the update streams also go to host
      memory as backward makes them (ZeRO-Offload), and the update reads
      them back a slice at a time.
    update_on: where the optimizer update runs when state is offloaded:
      ``"device"`` (the default) streams the offloaded state through the
      device a slice at a time (a loop over the layer axis of stacked
      leaves, and rows of other large leaves: ``zero_jax.offload``), so the
      device holds a few slices of master and moments, never all of them.
      Exact for updates that keep rows and leaves apart (adam, adamw, lion,
      sgd, adafactor); a global norm in ``tx`` is an error that names
      ``clip_grad_norm``. ``"host"`` is ZeRO-Offload's
      split (``zero_jax.offload``): master and optimizer state live in
      host RAM on this process's CPU devices, a program of their own
      updates them there with every core, and only gradients (down) and
      the compute copy (up) cross to the device, which holds the compute
      copy, gradients and activations: 6 bytes a parameter per step with
      bf16 compute, 4 with ``reduce_dtype="bfloat16"``. Give JAX one CPU device per core
      (``jax.config.update("jax_num_cpu_devices", os.cpu_count())`` before
      JAX starts). Any optax chain is exact. Single-process runs only.
    delay_update: with ``update_on="host"``, DeepSpeed's one-step delayed
      parameter update: each step's forward and backward read the
      parameters from before the previous step's update (the first step
      after ``init`` or a restore reads the current ones), so the host
      updates step t while the device computes step t+1. This changes the
      math: every gradient is applied one update late. It hides the host
      update's time; the device briefly holds two compute copies.
    skip_nonfinite: a step whose global gradient norm is not finite (NaN
      or inf gradients in fp32/bf16) is skipped on all devices: the state
      stays as it was except the step counter, and the metrics say
      ``skipped``; float16 keeps its loss-scale rules.
    max_consecutive_skips: after this many skipped steps in a row the next
      ``engine.step`` raises ``FloatingPointError``; must be an int >= 1.
    quantized_weights: ZeRO++'s qwZ (DeepSpeed's
      ``zero_quantized_weights``), stage 3 only: parameters are
      all-gathered as int8 blocks of 256 elements, each with a float32
      scale (about 0.51x the bytes of a bf16 gather), made from the float32
      master shard and dequantized to ``compute_dtype`` at use. Approximate:
      each gathered element is off by at most half its block's ``max |w| /
      127``; gradients are taken as if the gather were exact.
    quantized_gradients: ZeRO++'s qgZ (DeepSpeed's
      ``zero_quantized_gradients``), stages 1-3: each sharded gradient
      crosses as int8 blocks of 256 elements with float32 scales, by an
      all-to-all, and every device dequantizes the blocks of its own shard
      and sums them in float32 (about 0.26x the bytes of a float32
      reduce-scatter). Approximate: each device's contribution is off by
      at most half its block's ``max |g| / 127``. Replicated leaves (below
      ``min_shard_elements``) are still all-reduced exactly. Not with
      ``loss_scope="global"``.
    prefetch: ``zero_jax.scan_layers`` gathers layer i+1's parameters
      while layer i runs, forward and backward (XLA combines a layer's
      gathers into one collective), and reduces a layer's gradients as
      one collective, issued while the next layer is differentiated. The
      step is compiled with ``zero_jax.layers.PREFETCH_COMPILER_OPTIONS``
      (two collectives in flight, a layer's gathers combined). At stage 2
      with a ``compute_dtype``, the state on the device and one
      micro-batch a step, no compute copy is kept between steps: forward
      gathers the master's shards in the compute dtype (each scanned layer
      one ahead; other parameters at first use) and keeps them for
      backward (PyTorch FSDP's SHARD_GRAD_OP), instead of all-gathering a
      replicated copy after the update with nothing to overlap.
      ``"auto"`` (default): on wherever the layout allows it, stage 3
      gathering from the float32 master or stage 2 as above (with
      accumulation ``"auto"`` keeps the all-gather after the
      update, once a step), ``remat="full"``, no Pa, hpZ or ``model``
      axis, more than one device (``Engine.describe`` says which), and a
      scan asking for another remat runs without it (at stage 2 it still
      gathers in forward and keeps what it gathered). ``True``: asked for;
      refused with an error where it cannot be honoured. ``False``: off.
      Exact: the same sums as without it. At stage 3 it holds the next
      layer's parameters and the last layer's gradients besides (about
      two layers' 16-bit parameters); see docs/usage.md. With
      ``loss_scope="global"`` (stage 3 only) the gathers and gradient
      sums are the compiler's, placed by sharding constraints; each
      layer's gradients are reduce-scattered in the iteration that makes
      them, and the step is compiled with
      ``zero_jax.layers.GLOBAL_PREFETCH_COMPILER_OPTIONS``.
    hpz_partition_size: ZeRO++'s hpZ (DeepSpeed's
      ``zero_hpz_partition_size``), stage 3 only; 1 (default) is off. K >
      1: the devices of a mesh ``make_mesh(replica=R)`` whose ``data``
      axis is K (one group of K devices per node). The fp32 master,
      optimizer state and gradients stay sharded over all ``R * K``
      devices, and each layer is gathered across the groups once in
      forward, into a 16-bit secondary copy sharded over its group (1/K
      of the parameters per device, kept for backward); backward's
      gathers read that copy and never leave the group. Exact (the same
      float32 sums: over the group, then across groups). Not with
      offload, prefetch or a ``model`` axis. With
      ``loss_scope="global"`` sharding constraints place the same two
      gathers, and each layer's gradient is summed over the group, then
      across groups, in ``reduce_dtype``.
    loss_scope: what ``loss_fn``'s value means. ``"global"`` (the
      default): one device's, given the whole global batch (padded token
      means, in-batch negatives, batch statistics), its collectives left
      to the compiler on the same layout; with a 16-bit ``compute_dtype``
      gradients are summed in it (``reduce_dtype`` None or the compute
      dtype). ``"per_device"``: the mean of ``loss_fn`` over the devices'
      slices of the batch, DeepSpeed's meaning, with its own collectives
      (16-bit gradients summed in float32; qgZ). hpZ and qwZ run with
      the global loss, gathered by sharding constraints; not qgZ, which
      quantizes each device's own gradient before the sum (the compiler's
      sums hold none), nor stage 2's ``prefetch=True`` (docs/usage.md).
    accumulation: what a step of several micro-batches
      (``grad_accum_steps > 1``) trains. None: the loss scope's own
      meaning (``"whole_batch"`` with a global loss; the mean over
      devices and micro-batches with a per-device one).
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

  Raises:
    ValueError: on construction, when a field has the wrong type (ints must
      be ints, not bools, floats or strings; bools must be bools) or is out
      of range, or when fields contradict each other. The message names
      the field, the value and the fix.
  """

  stage: int = 3
  min_shard_elements: int = 1024
  seed: int = 0
  remat: RematPolicy | str = RematPolicy.FULL
  remat_names: tuple[str, ...] = ()
  partition_activations: bool = False
  device_memory_bytes: int | None = None
  layer_classes: tuple[str, ...] | None = None
  compute_dtype: str | None = None
  reduce_dtype: str | None = None
  grad_accum_steps: int | None = None
  train_batch_size: int | None = None
  micro_batch_size: int | None = None
  clip_grad_norm: float | None = None
  loss_scale: float = 0.0
  initial_scale_power: int = 16
  loss_scale_window: int = 1000
  hysteresis: int = 2
  min_loss_scale: float = 1.0
  consecutive_hysteresis: bool = False
  offload_optimizer: str | None = None
  offload_params: str | None = None
  nvme_path: str | None = None
  nvme: NvmeOptions = NvmeOptions()
  update_on: str = "device"
  delay_update: bool = False
  skip_nonfinite: bool = True
  max_consecutive_skips: int = 10
  quantized_weights: bool = False
  quantized_gradients: bool = False
  prefetch: bool | str = "auto"
  hpz_partition_size: int = 1
  loss_scope: str = "global"
  accumulation: str | None = None

  def __post_init__(self):
    self._check_fields()
    check_combinations(self)

  def _set(self, name: str, value: Any) -> None:
    object.__setattr__(self, name, value)  # the dataclass is frozen

  def _check(self, name: str, check: Callable[..., Any], *args: Any,
             **kwargs: Any) -> None:
    """Sets field ``name`` to ``check(<its full name>, <value>, ...)``."""
    self._set(name, check(f"ZeroConfig.{name}", getattr(self, name), *args,
                          **kwargs))

  def _fail(self, name: str, what: str, fix: str) -> NoReturn:
    """Raises the error of a field whose value is not ``what``."""
    fail(f"ZeroConfig.{name}", what, getattr(self, name), fix)

  def _check_fields(self) -> None:
    """Checks each field on its own, normalizing numbers to int/float.

    (numpy scalars become Python ones, so that equal configs hash alike.)
    """
    self._check("stage", check_choice, STAGES,
                "use 0 for plain data parallelism, 1 to shard optimizer "
                "state, 2 to also shard gradients, 3 to also shard "
                "parameters.")
    self._check("min_shard_elements", check_int, 0,
                fix="use 0 to shard every leaf that has a dimension "
                "divisible by the number of devices.")
    self._check("seed", check_int, *_INT64,
                fix="jax.random.PRNGKey takes an integer that fits in int64.")
    if not isinstance(self.remat, str) or self.remat not in REMAT_POLICIES:
      self._fail("remat", f"one of {sorted(REMAT_POLICIES)}",
                 "'full' (the default) recomputes each layer in backward.")
    if isinstance(self.remat_names, (str, bytes)):
      raise ValueError("ZeroConfig.remat_names must be a tuple of names, got "
                       f"the string {self.remat_names!r}; write "
                       f"({self.remat_names!r},)")
    try:
      names = tuple(self.remat_names)
    except TypeError:
      self._fail("remat_names", "a tuple of checkpoint_name tags",
                 "write e.g. ('mlp_hidden',), or () for none.")
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
      self._fail("remat_names", "a tuple of non-empty strings",
                 f"{bad[0]!r} is not a checkpoint_name tag; write the names "
                 "given to zero_jax.checkpoint_name.")
    self._set("remat_names", names)
    # (As the enum: equal to its name, so remat="full" reads the same.)
    self._set("remat", check_remat(self.remat, names))
    self._check("device_memory_bytes", check_int, 1, optional=True,
                fix="give bytes per device, e.g. 80 * 2**30, or None for "
                "what the device reports.")
    classes = self.layer_classes
    if classes is not None:
      if (isinstance(classes, (str, bytes)) or
          not isinstance(classes, (tuple, list)) or
          not all(isinstance(c, str) and c for c in classes)):
        self._fail("layer_classes", "None or a tuple of class names",
                   "write e.g. ('Block',), or () to run no block as a unit.")
      self._set("layer_classes", tuple(classes))
    for name in ("compute_dtype", "reduce_dtype"):
      value = getattr(self, name)
      if value is None:
        continue
      try:
        canonical = jnp.dtype(value).name
      except (TypeError, ValueError):
        canonical = None
      if canonical not in _COMPUTE_DTYPES:
        self._fail(name, f"None or one of {_COMPUTE_DTYPES}",
                   "None keeps float32" + (
                       " throughout." if name == "compute_dtype" else
                       " sums; 'bfloat16' sums in bf16."))
      self._set(name, canonical)
    for name, fix in (
        ("grad_accum_steps", "None runs one micro-batch per step, or "
         "derives the count from the batch sizes."),
        ("train_batch_size", "None leaves the global batch free."),
        ("micro_batch_size", "None leaves the per-device batch free.")):
      self._check(name, check_int, 1, optional=True, fix=fix)
    self._check("clip_grad_norm", check_float, 0.0, strict=True,
                optional=True, what="None (no clipping) or a finite number > 0",
                fix="use None to turn clipping off, or a norm such as 1.0.")
    self._check("loss_scale", check_float, 0.0, maximum=_FLOAT32_MAX,
                what="0 (dynamic) or a finite number > 0 (static) that fits "
                "in float32", fix="use 0 for dynamic loss scaling, or a "
                "power of two such as 1024.0 for a static scale.")
    self._check("initial_scale_power", check_int, 0, _MAX_SCALE_POWER,
                fix=(f"the loss scale 2**power is kept in float32, where 2**"
                     f"{_MAX_SCALE_POWER + 1} and above are inf (every step "
                     f"would overflow and be skipped); the largest allowed "
                     f"power is {_MAX_SCALE_POWER} (DeepSpeed's default is "
                     f"16)."))
    self._check("loss_scale_window", check_int, 1, _INT32_MAX,
                fix="it counts the clean steps before the dynamic scale "
                "doubles (DeepSpeed's default is 1000).")
    self._check("hysteresis", check_int, 1, _INT32_MAX,
                fix="it counts the overflows tolerated before the scale "
                "halves (DeepSpeed's default is 2; 1 halves at once).")
    max_scale = 2.0 ** self.initial_scale_power
    self._check("min_loss_scale", check_float, 0.0, strict=True,
                maximum=max_scale,
                what=f"> 0 and at most the initial scale 2**"
                f"{self.initial_scale_power} = {max_scale:g}",
                fix="lower min_loss_scale (the default is 1.0), or raise "
                "initial_scale_power.")
    self._check("consecutive_hysteresis", check_bool,
                "True refills the hysteresis on every clean step.")
    for name, value in offload_fields(self).items():
      self._set(name, value)
    self._check("partition_activations", check_bool,
                "True splits each saved layer input over the 'model' axis "
                "along the sequence (ZeRO-R's Pa).")
    self._check("skip_nonfinite", check_bool,
                "True skips steps whose gradients hold NaN or inf, False "
                "applies them.")
    self._check("max_consecutive_skips", check_int, 1, _INT32_MAX,
                fix="it counts the skipped steps in a row tolerated before "
                "engine.step raises FloatingPointError (the default is 10).")
    self._check("quantized_weights", check_bool,
                "True (stage 3) gathers the parameters as int8 blocks "
                "(ZeRO++'s qwZ).")
    self._check("quantized_gradients", check_bool,
                "True (stages 1-3) sums the gradients from int8 blocks "
                "(ZeRO++'s qgZ).")
    if self.prefetch != "auto":
      self._check("prefetch", check_bool,
                  "'auto' (the default) gathers each scanned layer one layer "
                  "ahead wherever the layout allows; True asks for it "
                  "(stage 3, remat='full'), False turns it off.",
                  what="True, False or 'auto'")
    self._check("hpz_partition_size", check_int, 1, _INT32_MAX,
                fix="it is the devices per hpZ group (one node), the "
                "'data' axis of make_mesh(replica=devices // size); 1 "
                "turns hpZ off.")
    self._check("loss_scope", check_choice, LOSS_SCOPES,
                "'global' (the default) means what loss_fn means on one "
                "device given the whole batch; 'per_device' averages "
                "loss_fn over the devices' slices (DeepSpeed's meaning).")
    self._check("accumulation", check_choice, ACCUMULATIONS,
                "None follows loss_scope; 'whole_batch' (loss_scope="
                "'global') trains the whole batch's loss, checked; "
                "'mean_of_micro_batches' averages the micro-batches' "
                "losses (DeepSpeed's meaning).")

  @property
  def dynamic_loss_scale(self) -> bool:
    """Whether steps use DeepSpeed-style dynamic loss scaling."""
    return self.compute_dtype == "float16" and self.loss_scale == 0

  def batch_sizes(self, world_size: int) -> tuple[int | None, int | None,
                                                  int]:
    """``(train_batch_size, micro_batch_size, grad_accum_steps)`` on
    ``world_size`` devices (every mesh axis), by DeepSpeed's rule
    ``train = micro * accum * world_size``: any two give the third, one
    alone leaves ``grad_accum_steps`` at 1, none leaves the global batch
    free (then the first two are None). Raises ``ValueError`` where they
    contradict each other or do not divide."""
    return resolve_batch_sizes(self.train_batch_size, self.micro_batch_size,
                               self.grad_accum_steps, world_size)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ZeroConfig":
    """Builds a config from a mapping, rejecting keys it does not know.

    Args:
      d: field names to values.

    Returns:
      The config.

    Raises:
      ValueError: a key is not a field of ``ZeroConfig``; the message lists
        the valid fields.
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise ValueError(
          f"unknown ZeroConfig key(s) {unknown}; valid keys are "
          f"{sorted(fields)}")
    return cls(**d)
