"""ZeRO configuration: a frozen dataclass of sections, validated on
construction (Levanter's nested configs), with DeepSpeed's flat keywords
as a shorthand."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from zero_jax._checks import (check_bool, check_choice, check_float,
                              check_int, fail)
from zero_jax.config._batch_sizes import resolve_batch_sizes
from zero_jax.config._combinations import check_combinations
from zero_jax.config._offload import Offload
from zero_jax.config._remat import Activations
from zero_jax.config._sections import (INT32_MAX, Batch, LossScaling,
                                       LossScope, MixedPrecision, Section,
                                       ZeroPP, from_mapping)

# The ZeRO stages: 0 (plain data parallelism) to 3.
STAGES = (0, 1, 2, 3)
# jax.random.PRNGKey takes a seed that fits in int64.
_INT64 = (int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max))
SECTIONS = (MixedPrecision, LossScaling, Offload, ZeroPP, Activations, Batch)
# Each flat keyword of the shorthand -> (section, field): the names
# DeepSpeed users and earlier versions write (ZeroConfig(compute_dtype=...)).
SHORTHAND: dict[str, tuple[str, str]] = {
    flat: (section.NAME, field) for section in SECTIONS
    for field, flat in section.SHORTHAND.items()}
_SECTION_OF = {section.NAME: section for section in SECTIONS}


@dataclasses.dataclass(frozen=True, init=False)
class ZeroConfig(Section):
  """How a model is laid out and trained over the batch axes of a mesh.

  Related fields are grouped in sections, each a frozen dataclass checked
  on its own: ``precision`` (``MixedPrecision``), ``loss_scaling``
  (``LossScaling``), ``offload`` (``Offload``), ``zeropp`` (``ZeroPP``),
  ``activations`` (``Activations``) and ``batch`` (``Batch``); a section
  may also be given as a mapping of its fields. Their fields are
  documented there.

  Shorthand: every section field also has a flat keyword, the name
  DeepSpeed users know (``SHORTHAND``): ``ZeroConfig(stage=3,
  offload_optimizer="host", compute_dtype="bfloat16")`` is
  ``ZeroConfig(stage=3, offload=Offload(optimizer="host"),
  precision=MixedPrecision(compute="bfloat16"))``, and reading
  ``config.offload_optimizer`` reads ``config.offload.optimizer``. A flat
  keyword given beside its section overrides that one field of it (so
  ``dataclasses.replace(config, compute_dtype=...)`` works).

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
    layer_classes: the blocks run one at a time (a block's parameters
      gathered at its call and in its remat'd backward at stage 3, its
      gradients reduce-scattered as backward leaves it at stages 2-3) when
      called in a Python loop (``zero_jax.layers``): None (the default)
      finds them, as sibling Flax modules with identical parameter shapes;
      a tuple of class names (Accelerate's wrap policy) names them; ``()``
      turns it off. Scanned layers (``scan_layers``) are per layer anyway.
    clip_grad_norm: clip gradients to this global norm over the whole model
      (optax's ``clip_by_global_norm`` semantics), computed exactly across
      every shard. None: no clipping. The pre-clip norm is always reported
      as the ``grad_norm`` metric.
    skip_nonfinite: a step whose global gradient norm is not finite (NaN
      or inf gradients in fp32/bf16) is skipped on all devices: the state
      stays as it was except the step counter, and the metrics say
      ``skipped``; float16 keeps its loss-scale rules.
    max_consecutive_skips: after this many skipped steps in a row the next
      ``engine.step`` raises ``FloatingPointError``; must be an int >= 1.
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
    precision: the dtypes of compute and of gradient sums
      (``MixedPrecision``; shorthand ``compute_dtype``, ``reduce_dtype``).
    loss_scaling: float16's loss scaling (``LossScaling``; shorthand
      ``loss_scale``, ``initial_scale_power``, ``loss_scale_window``,
      ``hysteresis``, ``min_loss_scale``, ``consecutive_hysteresis``).
    offload: offloaded state and where its update runs (``Offload``;
      shorthand ``offload_optimizer``, ``offload_params``, ``update_on``,
      ``delay_update``, ``nvme_path``, ``nvme``).
    zeropp: ZeRO++'s qwZ, qgZ and hpZ (``ZeroPP``; shorthand
      ``quantized_weights``, ``quantized_gradients``,
      ``hpz_partition_size``).
    activations: remat and ZeRO-R's Pa (``Activations``; shorthand
      ``remat``, ``remat_names``, ``partition_activations``,
      ``device_memory_bytes``).
    batch: batch sizes and what accumulation trains (``Batch``; shorthand
      ``train_batch_size``, ``micro_batch_size``, ``grad_accum_steps``,
      ``accumulation``).

  Raises:
    ValueError: on construction, when a field has the wrong type (ints must
      be ints, not bools, floats or strings; bools must be bools) or is out
      of range, when a keyword is neither a field nor a shorthand, or when
      fields contradict each other. The message names the field, the value
      and the fix.
  """

  stage: int = 3
  min_shard_elements: int = 1024
  seed: int = 0
  layer_classes: tuple[str, ...] | None = None
  clip_grad_norm: float | None = None
  skip_nonfinite: bool = True
  max_consecutive_skips: int = 10
  prefetch: bool | str = "auto"
  loss_scope: LossScope = LossScope.GLOBAL
  precision: MixedPrecision = MixedPrecision()
  loss_scaling: LossScaling = LossScaling()
  offload: Offload = Offload()
  zeropp: ZeroPP = ZeroPP()
  activations: Activations = Activations()
  batch: Batch = Batch()

  def __init__(self, stage: int = 3, min_shard_elements: int = 1024,
               seed: int = 0, layer_classes: tuple[str, ...] | None = None,
               clip_grad_norm: float | None = None,
               skip_nonfinite: bool = True, max_consecutive_skips: int = 10,
               prefetch: bool | str = "auto",
               loss_scope: LossScope | str = LossScope.GLOBAL,
               precision: MixedPrecision | Mapping[str, Any] | None = None,
               loss_scaling: LossScaling | Mapping[str, Any] | None = None,
               offload: Offload | Mapping[str, Any] | None = None,
               zeropp: ZeroPP | Mapping[str, Any] | None = None,
               activations: Activations | Mapping[str, Any] | None = None,
               batch: Batch | Mapping[str, Any] | None = None,
               **shorthand: Any):
    given = dict(precision=precision, loss_scaling=loss_scaling,
                 offload=offload, zeropp=zeropp, activations=activations,
                 batch=batch)
    unknown = sorted(set(shorthand) - set(SHORTHAND))
    if unknown:
      raise ValueError(
          f"unknown ZeroConfig key(s) {unknown}; valid keys are the fields "
          f"{sorted(f.name for f in dataclasses.fields(ZeroConfig))} and "
          f"the shorthand {sorted(SHORTHAND)}")
    for name, value in dict(
        stage=stage, min_shard_elements=min_shard_elements, seed=seed,
        layer_classes=layer_classes, clip_grad_norm=clip_grad_norm,
        skip_nonfinite=skip_nonfinite,
        max_consecutive_skips=max_consecutive_skips, prefetch=prefetch,
        loss_scope=loss_scope).items():
      self._set(name, value)
    for name, value in given.items():
      overrides = {field: shorthand[flat] for flat, (section, field)
                   in SHORTHAND.items()
                   if section == name and flat in shorthand}
      self._set(name, _section(name, value, overrides))
    self._check_fields()
    check_combinations(self)

  def __getattr__(self, name: str) -> Any:
    # (Only for names that are not attributes: the shorthand's.)
    where = SHORTHAND.get(name)
    if where is None:
      raise AttributeError(
          f"'ZeroConfig' object has no attribute {name!r}")
    return getattr(object.__getattribute__(self, where[0]), where[1])

  def _label(self, name: str) -> str:
    """A top-level field's full name, for messages."""
    return f"ZeroConfig.{name}"

  def _check_fields(self) -> None:
    """Checks each top-level field on its own, normalizing numbers to
    int/float (numpy scalars become Python ones, so that equal configs hash
    alike)."""
    self._check("stage", check_choice, STAGES,
                "use 0 for plain data parallelism, 1 to shard optimizer "
                "state, 2 to also shard gradients, 3 to also shard "
                "parameters.")
    self._check("min_shard_elements", check_int, 0,
                fix="use 0 to shard every leaf that has a dimension "
                "divisible by the number of devices.")
    self._check("seed", check_int, *_INT64,
                fix="jax.random.PRNGKey takes an integer that fits in int64.")
    classes = self.layer_classes
    if classes is not None:
      if (isinstance(classes, (str, bytes)) or
          not isinstance(classes, (tuple, list)) or
          not all(isinstance(c, str) and c for c in classes)):
        self._fail("layer_classes", "None or a tuple of class names",
                   "write e.g. ('Block',), or () to run no block as a unit.")
      self._set("layer_classes", tuple(classes))
    self._check("clip_grad_norm", check_float, 0.0, strict=True,
                optional=True, what="None (no clipping) or a finite number > 0",
                fix="use None to turn clipping off, or a norm such as 1.0.")
    self._check("skip_nonfinite", check_bool,
                "True skips steps whose gradients hold NaN or inf, False "
                "applies them.")
    self._check("max_consecutive_skips", check_int, 1, INT32_MAX,
                fix="it counts the skipped steps in a row tolerated before "
                "engine.step raises FloatingPointError (the default is 10).")
    if self.prefetch != "auto":
      self._check("prefetch", check_bool,
                  "'auto' (the default) gathers each scanned layer one layer "
                  "ahead wherever the layout allows; True asks for it "
                  "(stage 3, remat='full'), False turns it off.",
                  what="True, False or 'auto'")
    self._check("loss_scope", check_choice, tuple(s.value for s in LossScope),
                "'global' (the default) means what loss_fn means on one "
                "device given the whole batch; 'per_device' averages "
                "loss_fn over the devices' slices (DeepSpeed's meaning).")
    self._set("loss_scope", LossScope(self.loss_scope))

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
    b = self.batch
    return resolve_batch_sizes(b.global_size, b.micro_size, b.accum_steps,
                               world_size)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ZeroConfig":
    """Builds a config from a mapping of fields (a section as a mapping of
    its own) and shorthand keywords, rejecting keys it does not know.

    Args:
      d: field or shorthand names to values.

    Returns:
      The config.

    Raises:
      ValueError: a key is neither a field of ``ZeroConfig`` nor a
        shorthand; the message lists the valid keys.
    """
    return cls(**d)


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
  """``flat``'s keywords as ``ZeroConfig``'s own fields: each shorthand
  keyword moved into a mapping of its section's fields (the nested form
  that DeepSpeed's reader builds). Other keys are kept as they are."""
  out: dict[str, Any] = {}
  for key, value in flat.items():
    where = SHORTHAND.get(key)
    if where is None:
      out[key] = value
    else:
      out.setdefault(where[0], {})[where[1]] = value
  return out


def _section(name: str, value: Any, overrides: dict[str, Any]) -> Any:
  """Section ``name`` from ``value`` (the section, a mapping of its fields,
  or None for its defaults), with ``overrides`` (its fields given by
  shorthand) in place."""
  kind = _SECTION_OF[name]
  if value is None:
    value = {}
  if isinstance(value, Mapping):
    return from_mapping(kind, value, f"ZeroConfig.{name}", **overrides)
  if not isinstance(value, kind):
    fail(f"ZeroConfig.{name}", f"an instance of {kind.__name__} or a "
         "mapping of its fields", value, f"e.g. zero_jax.{kind.__name__}()")
  return dataclasses.replace(value, **overrides) if overrides else value
