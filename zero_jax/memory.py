"""Memory and communication per device: analytic models and measurements.

The paper (arXiv:1910.02054, section 5) counts model-state bytes per device
for Ψ parameters on N devices, with 2-byte params and gradients and K bytes
of optimizer state per parameter (K = 12 for mixed-precision Adam). For fp32
training params and gradients are 4 bytes and K = 8 (Adam's two moments).

Three kinds of numbers live here:

- the paper's formula (``paper_model_state_bytes``, ``paper_estimate``);
- an analytic model of zero_jax's *own* layouts (``estimate``,
  ``communication``, ``activation_bytes``), which differ from the paper's:
  no gradient buffer persists between steps, and with fp32 compute the
  replicated parameters of stages 0-2 are also the master copy;
- measurements of a real engine (``compiled_memory``, ``train_state_bytes``,
  ``comm_in_psi`` over ``zero_jax.hlo.summarize``).

Example::

  est = estimate(7.5e9, devices=64, stage=3, optimizer="adamw")
  est.model_states / 2**30            # GiB per device
  communication(7.5e9, 64, 3)         # {"all-gather": {...}, ...}
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax.config import ZeroConfig
from zero_jax.placement import Placement


_PSI_FIX = ("pass the parameter count, e.g. 7.5e9 (zero_jax.memory."
            "param_count(params) counts a tree)")
_BYTES_FIX = "pass bytes per element, e.g. 2 for bfloat16 or 4 for float32"


def _check_number(name: str, value: Any, *, strict: bool = True,
                  fix: str) -> Any:
  """``value`` if it is a finite real number > 0 (>= 0 unless strict).

  Raises:
    ValueError: it is not (bools, strings, nan and inf included); the
      message names the argument, the value and ``fix``.
  """
  if (isinstance(value, numbers.Real) and not isinstance(value, bool)
      and math.isfinite(value) and (value > 0 if strict else value >= 0)):
    return value
  raise ValueError(f"{name} must be a finite number {'>' if strict else '>='}"
                   f" 0, got {value!r}; {fix}")


def _check_count(name: str, value: Any, minimum: int = 1, *,
                 fix: str) -> int:
  """``value`` if it is an integer >= minimum (not a bool or a float)."""
  if (isinstance(value, numbers.Integral) and not isinstance(value, bool)
      and value >= minimum):
    return int(value)
  hint = (f"write {int(value)}, an int; " if isinstance(value, float)
          and value.is_integer() else "")
  raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}; "
                   f"{hint}{fix}")


def _check_flag(name: str, value: Any) -> bool:
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise ValueError(f"{name} must be True or False, got {value!r}; True "
                   f"stands for ZeroConfig({name}='host')")


def _check_finite(what: str, values: Mapping[str, float]) -> None:
  """Raises when a result overflowed float64 (finite inputs, huge product)."""
  bad = {k: v for k, v in values.items() if not math.isfinite(v)}
  if bad:
    raise ValueError(f"{what} overflows a float64 ({bad}): the inputs are "
                     "too large to be real; check the parameter count and "
                     "bytes per parameter")


def paper_model_state_bytes(psi: float, n: int, stage: int, *,
                            param_bytes: int = 2, grad_bytes: int = 2,
                            k: int = 12) -> float:
  """Per-device model-state bytes of the ZeRO paper's formula.

  Args:
    psi: parameter count Ψ.
    n: data-parallel devices N.
    stage: 0 (plain DP), 1 (P_os), 2 (P_os+g), 3 (P_os+g+p).
    param_bytes: bytes per parameter (2 for fp16/bf16 compute, 4 for fp32).
    grad_bytes: bytes per gradient element.
    k: optimizer-state bytes per parameter (12 for mixed-precision Adam,
      8 for fp32 Adam).

  Returns:
    Bytes per device.

  Raises:
    ValueError: a size is not finite, or negative (Ψ and N also not 0), or
      the stage is not 0-3.
  """
  _check_paper_args(psi, n, stage, param_bytes, grad_bytes, k)
  p, g, o = param_bytes * psi, grad_bytes * psi, k * psi
  if stage == 0:
    return p + g + o
  if stage == 1:
    return p + g + o / n
  if stage == 2:
    return p + (g + o) / n
  if stage == 3:
    return (p + g + o) / n
  raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """Per-device bytes of a compiled step (from ``memory_analysis()``).

  Attributes:
    argument: bytes of all inputs (train state and batch).
    output: bytes of all outputs.
    temp: scratch bytes live during the step.
    alias: bytes of outputs that reuse donated inputs.
    host: bytes in host memory (``pinned_host``: offloaded arguments,
      outputs and scratch); not part of ``peak``. Only programs compiled
      for devices with host memory kinds (GPUs, TPUs) report any.
  """

  argument: int
  output: int
  temp: int
  alias: int
  host: int = 0

  @property
  def peak(self) -> int:
    """argument + output + temp - alias. (On CPU, ``peak_memory_in_bytes``
    leaves out temp, so it is recomputed here.)"""
    return self.argument + self.output + self.temp - self.alias


def compiled_memory(compiled) -> CompiledMemory:
  """Reads per-device byte counts off a compiled (``.compile()``) function."""
  ma = compiled.memory_analysis()
  host = lambda name: int(getattr(ma, f"host_{name}_size_in_bytes", 0) or 0)
  return CompiledMemory(argument=int(ma.argument_size_in_bytes),
                        output=int(ma.output_size_in_bytes),
                        temp=int(ma.temp_size_in_bytes),
                        alias=int(ma.alias_size_in_bytes),
                        host=(host("argument") + host("output") +
                              host("temp") - host("alias")))


def per_device_bytes(tree: Any) -> int:
  """Bytes a pytree of (possibly sharded) arrays holds on its busiest device.

  Works on concrete arrays and on ``jax.ShapeDtypeStruct`` with a sharding.
  """
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.shape
    sharding = getattr(x, "sharding", None)
    if sharding is not None:
      shape = sharding.shard_shape(x.shape)
    total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
  return total


def bytes_by_memory_kind(tree: Any) -> dict[str, int]:
  """``per_device_bytes`` split by where each leaf lives: ``{"device": ...,
  "pinned_host": ...}`` (a kind absent from the tree is absent here)."""
  out: dict[str, int] = {}
  for x in jax.tree.leaves(tree):
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    kind = "device" if kind in (None, "device") else kind
    out[kind] = out.get(kind, 0) + per_device_bytes(x)
  return out


def param_count(tree: Any) -> int:
  """Number of elements Ψ in a pytree of arrays."""
  return sum(int(np.prod(np.shape(x), dtype=np.int64))
             for x in jax.tree.leaves(tree))


# ------------------------------------------------------- analytic: zero_jax

# Optimizer-state bytes per parameter (fp32 state) of common optax optimizers.
OPTIMIZER_STATE_BYTES: dict[str, float] = {
    "adam": 8,          # first and second moments
    "adamw": 8,
    "sgd": 0,           # stateless
    "sgd_momentum": 4,  # one trace
    "lion": 4,          # one moment
    # Factored second moments: a row and a column vector per matrix, about 0
    # bytes per parameter. Counted as 0; vectors and leaves below
    # ``min_dim_size_to_factor`` keep a full moment and are left out.
    "adafactor": 0,
}

_STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Bytes per device of one training setup, by kind.

  Attributes:
    params: every parameter copy kept between steps: the fp32 master, plus,
      at stages 1-2 with a 16-bit compute dtype, the replicated compute copy.
    grads: one step's gradients. In zero_jax they are live only during the
      step (a functional step keeps no gradient buffer), but they are live at
      the optimizer update; the paper counts them as a persistent buffer.
    opt_state: optimizer state.
    activations: activations saved for backward (0 when not estimated).
    host: state kept in host memory instead (offload; per device, so a
      host's RAM must hold this times its devices). ``params`` and
      ``opt_state`` count device memory only.
    host_grads: gradients sent to host memory as backward makes them
      (stage 3 offload with one micro-batch: ``Placement.grads_on_host``);
      ``grads`` then counts none. An upper bound: small leaves' gradients
      stay on the device.
  """

  params: float
  grads: float
  opt_state: float
  activations: float = 0.0
  host: float = 0.0
  host_grads: float = 0.0

  @property
  def model_states(self) -> float:
    """params + grads + opt_state: what the paper counts."""
    return self.params + self.grads + self.opt_state

  @property
  def persistent(self) -> float:
    """params + opt_state: what zero_jax's ``TrainState`` holds."""
    return self.params + self.opt_state

  @property
  def total(self) -> float:
    """model_states + activations."""
    return self.model_states + self.activations


def _data_axis(devices: int, replica: int) -> int:
  devices = _check_count("devices", devices,
                         fix="pass the number of devices in all, e.g. "
                         "jax.device_count()")
  replica = _check_count("replica", replica,
                         fix="pass the replica groups R (1: one group)")
  if devices % replica:
    raise ValueError(
        f"devices={devices} is not divisible by replica={replica}: state is "
        "sharded over devices // replica devices and replicated over replica "
        "groups")
  return devices // replica


def _check_stage(stage: int) -> None:
  if not (isinstance(stage, numbers.Integral) and not isinstance(stage, bool)
          and stage in _STAGES):
    raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")


def _check_paper_args(psi: float, n: int, stage: int, param_bytes: float,
                      grad_bytes: float, k: float) -> None:
  """The checks shared by the paper's formula and its split."""
  _check_number("psi", psi, fix=_PSI_FIX)
  _check_count("n", n, fix="pass the data-parallel devices N")
  _check_stage(stage)
  _check_number("param_bytes", param_bytes, strict=False, fix=_BYTES_FIX)
  _check_number("grad_bytes", grad_bytes, strict=False, fix=_BYTES_FIX)
  _check_number("k", k, strict=False,
                fix="pass optimizer-state bytes per parameter, e.g. 12")


def _check_replicated(replicated: float, psi: float) -> float:
  """Replicated parameters: a finite count in [0, psi]."""
  _check_number("replicated", replicated, strict=False,
                fix="pass the count of parameters that stay replicated "
                "(Engine.param_plan.replicated_elements), 0 for none")
  if replicated > psi:
    raise ValueError(f"replicated={replicated!r} exceeds the parameter "
                     f"count psi={psi!r}; it counts parameters among the psi "
                     "(Engine.param_plan.replicated_elements): pass at most "
                     "psi")
  return replicated


def optimizer_state_bytes(optimizer: str = "adamw",
                          k: float | None = None) -> float:
  """Optimizer-state bytes per parameter K.

  Args:
    optimizer: a key of ``OPTIMIZER_STATE_BYTES``.
    k: explicit bytes per parameter; overrides ``optimizer``.

  Returns:
    K.

  Raises:
    ValueError: unknown optimizer (the message lists the known ones) or
      a ``k`` that is negative or not finite.
  """
  if k is not None:
    return _check_number("k", k, strict=False,
                         fix="pass optimizer-state bytes per parameter, "
                         "e.g. 8 for fp32 Adam")
  if optimizer not in OPTIMIZER_STATE_BYTES:
    raise ValueError(f"unknown optimizer {optimizer!r}; known: "
                     f"{sorted(OPTIMIZER_STATE_BYTES)} (or pass k=bytes per "
                     "parameter)")
  return OPTIMIZER_STATE_BYTES[optimizer]


def _compute_bytes(compute_dtype: Any) -> int | None:
  """Bytes of a 16-bit (or 8-bit) compute dtype; None for fp32 compute."""
  if compute_dtype is None:
    return None
  try:
    dt = jnp.dtype(compute_dtype)
  except TypeError:
    dt = None
  if dt is None or not jnp.issubdtype(dt, jnp.floating) or dt.itemsize > 4:
    raise ValueError(f"compute_dtype must be a float of at most 4 bytes "
                     f"(e.g. 'bfloat16'), got {compute_dtype!r}")
  # fp32 compute is fp32 training: no separate compute copy.
  return None if dt.itemsize == 4 else dt.itemsize


def estimate_memory(psi: float, devices: int, stage: int, *,
                    optimizer: str = "adamw", k: float | None = None,
                    compute_dtype: Any = None, replica: int = 1,
                    activations: float | None = None,
                    replicated: float = 0, offload_optimizer: bool = False,
                    offload_params: bool = False,
                    update_on: str = "device") -> Estimate:
  """Per-device bytes of zero_jax's layouts for Ψ parameters (analytic).

  N = ``devices // replica`` is the ``data`` axis state is sharded over;
  the ``replica`` groups each hold a full set of shards. K is the
  optimizer-state bytes per parameter. With fp32 training (no
  ``compute_dtype``):

  ====== ============= ============ ===========
  stage  params        grads        opt_state
  ====== ============= ============ ===========
  0      4Ψ            4Ψ           KΨ
  1      4Ψ            4Ψ           KΨ/N
  2      4Ψ            4Ψ/N         KΨ/N
  3      4Ψ/N          4Ψ/N         KΨ/N
  ====== ============= ============ ===========

  At stages 0-2 the replicated fp32 parameters are also the master copy
  (each device updates the slice it owns), so no second copy is kept. With
  a compute dtype of c bytes (2 for bf16/fp16): stage 0 keeps the fp32
  master 4Ψ, grads cΨ; stages 1-2 a fp32 master shard 4Ψ/N plus a
  replicated compute copy cΨ, grads cΨ (stage 1) or cΨ/N (stage 2); stage 3
  a master shard 4Ψ/N and grads 4Ψ/N.

  Offload (``ZeroConfig.offload_optimizer`` / ``offload_params``) moves
  state from ``params``/``opt_state`` to ``host``: the optimizer state; the
  fp32 master wherever forward reads a compute copy (stages 1-2 with a
  compute dtype; stage 3 with one then keeps a cΨ/N compute shard on the
  device); with ``offload_params`` (stage 3) the master shard.

  Args:
    psi: parameter count Ψ.
    devices: devices in all.
    stage: ZeRO stage 0-3.
    optimizer: a key of ``OPTIMIZER_STATE_BYTES`` (K: adam/adamw 8, sgd 0,
      sgd_momentum 4, lion 4, adafactor ~0).
    k: explicit optimizer-state bytes per parameter; overrides
      ``optimizer``.
    compute_dtype: e.g. ``"bfloat16"``; None (or a 4-byte float) for fp32
      training.
    replica: replica groups R (``devices`` must be divisible by it).
    activations: activation bytes per device to add (e.g. from
      ``estimate_activations``); None for 0.
    replicated: parameters that stay replicated whatever the stage (leaves
      below ``min_shard_elements`` or with no dimension divisible by N; see
      ``Engine.describe()``). 0 gives the ideal layout; the count makes the
      estimate match a real engine to the byte, up to scalars such as
      Adam's step count.
    offload_optimizer: ``ZeroConfig(offload_optimizer="host")``.
    offload_params: ``ZeroConfig(offload_params="host")`` (stage 3).
    update_on: ``ZeroConfig.update_on``: ``"host"`` keeps master and
      optimizer state on the host and a compute copy (float32 in fp32
      training) on the device.

  Returns:
    The estimate.

  Raises:
    ValueError: ``psi`` or ``devices`` is not finite or not > 0,
      ``replica`` does not divide ``devices``, ``activations`` or
      ``replicated`` is negative or not finite (or ``replicated`` > ``psi``),
      or the options make an invalid ``ZeroConfig`` (its message names the
      field).
  """
  _check_number("psi", psi, fix=_PSI_FIX)
  n = _data_axis(devices, replica)
  _check_stage(stage)
  kb = optimizer_state_bytes(optimizer, k)
  c = _compute_bytes(compute_dtype)
  r = _check_replicated(replicated, psi)
  if activations is not None:
    _check_number("activations", activations, strict=False,
                  fix="pass activation bytes per device (e.g. from "
                  "estimate_activations), or None")
  offload_optimizer = _check_flag("offload_optimizer", offload_optimizer)
  offload_params = _check_flag("offload_params", offload_params)
  full = lambda b: b * psi
  sharded = lambda b: b * ((psi - r) / n + r)
  if offload_params and stage != 3:
    raise ValueError(f"offload_params needs stage 3, got stage={stage}: only "
                     "stage 3 shards the parameters it would stream; at "
                     "stages 1-2 pass offload_optimizer=True with a "
                     "compute_dtype to offload the fp32 master")
  # Where master, moments and the compute copy live: the engine's rules.
  # (Only whether a 16-bit copy exists matters to the layout; c sizes it.)
  pl = Placement.of(ZeroConfig(
      stage=stage, compute_dtype=None if c is None else "bfloat16",
      offload_optimizer="host" if offload_optimizer else None,
      offload_params="host" if offload_params else None,
      update_on=update_on))
  master = sharded(4) if pl.master_sharded else full(4)
  # (With update_on="host" the device's copy is float32 in fp32 training.)
  cc = c or (4 if pl.update == "host" else 0)
  compute = {"replicated": full(cc), "sharded": sharded(cc),
             None: 0.0}[pl.compute_copy]
  opt_state = full(kb) if stage == 0 else sharded(kb)
  # Gradients live at the update: in the compute dtype where backward
  # leaves them whole (stages 0-1), reduce-scattered shards at stages 2-3
  # (fp32 at stage 3, where they are the master's).
  if c is None:
    grads = full(4) if stage < 2 else sharded(4)
  else:
    grads = (full(c) if stage < 2 else sharded(c) if stage == 2 else
             sharded(4))
  host = ((master if pl.master_on_host else 0.0) +
          (opt_state if pl.opt_on_host else 0.0))
  if pl.compute_memory != "device":
    host, compute = host + compute, 0.0
  params = compute + (0.0 if pl.master_on_host else master)
  opt_state = 0.0 if pl.opt_on_host else opt_state
  host_grads = 0.0
  if pl.grads_on_host:
    host_grads, grads = grads, 0.0
  est = Estimate(params=float(params), grads=float(grads),
                 opt_state=float(opt_state),
                 activations=float(activations or 0), host=float(host),
                 host_grads=float(host_grads))
  _check_finite(f"estimate_memory(psi={psi!r}, k={kb!r})",
                dataclasses.asdict(est) | {"total": est.total})
  return est


def paper_estimate(psi: float, n: int, stage: int, *, param_bytes: int = 2,
                   grad_bytes: int = 2, k: float = 12) -> Estimate:
  """The paper's formula (``paper_model_state_bytes``), split by kind.

  Args:
    psi: parameter count Ψ.
    n: data-parallel devices N.
    stage: 0-3.
    param_bytes: bytes per parameter (2 for mixed precision, 4 for fp32).
    grad_bytes: bytes per gradient element.
    k: optimizer-state bytes per parameter (12 for mixed-precision Adam:
      fp32 master + two moments; 8 for fp32 Adam).

  Returns:
    The estimate (no activations: the paper counts model states).

  Raises:
    ValueError: as ``paper_model_state_bytes``.
  """
  _check_paper_args(psi, n, stage, param_bytes, grad_bytes, k)
  p, g, o = param_bytes * psi, grad_bytes * psi, k * psi
  return Estimate(params=p / n if stage >= 3 else p,
                  grads=g / n if stage >= 2 else g,
                  opt_state=o / n if stage >= 1 else o)


def estimate_activations(*, layers: int, hidden: int, seq_len: int,
                         micro_batch: int, heads: int, vocab: int = 0,
                         bytes_per_element: float = 2,
                         remat: str = "full") -> float:
  """Activation bytes per device of a GPT-style transformer (an estimate).

  Per layer without recomputation, Korthikanti et al. (arXiv:2205.05198,
  section 4.1) count ``T b d (34 + 5 a T / d)`` bytes with 16-bit
  activations (T = seq_len, b = micro_batch, d = hidden, a = heads); it is
  scaled by ``bytes_per_element / 2``. With full per-layer remat only each
  layer's input (``T b d`` elements) is saved, plus one layer's working set
  while it is recomputed in backward. The logits and their gradient add
  ``2 b T V`` elements. Real use depends on XLA's fusion and scheduling:
  this is a planning number, not a measurement. DeepSpeed's estimator counts
  model states only, which is why it is often far from observed use.

  Args:
    layers: transformer blocks L.
    hidden: model width d.
    seq_len: tokens per sequence T.
    micro_batch: sequences per device per step b.
    heads: attention heads a.
    vocab: vocabulary size V (0 leaves the logits out).
    bytes_per_element: 2 for bf16/fp16 activations, 4 for fp32.
    remat: ``"full"`` (per-layer recomputation, zero_jax's default) or
      ``"none"``.

  Returns:
    Bytes per device.

  Raises:
    ValueError: a dimension is not an integer >= 1 (``vocab`` >= 0),
      ``bytes_per_element`` is not a finite number > 0, or ``remat`` is
      neither ``"full"`` nor ``"none"``.
  """
  for name, value in (("layers", layers), ("hidden", hidden),
                      ("seq_len", seq_len), ("micro_batch", micro_batch),
                      ("heads", heads)):
    _check_count(name, value, fix="pass the model's shape")
  _check_count("vocab", vocab, 0, fix="pass the vocabulary size, or 0 to "
               "leave the logits out")
  _check_number("bytes_per_element", bytes_per_element, fix=_BYTES_FIX)
  if not isinstance(remat, str) or remat not in ("full", "none"):
    raise ValueError(f"remat must be 'full' or 'none', got {remat!r}")
  tbd = seq_len * micro_batch * hidden
  per_layer = (tbd * (34 + 5 * heads * seq_len / hidden) *
               bytes_per_element / 2)
  logits = 2 * micro_batch * seq_len * vocab * bytes_per_element
  if remat == "none":
    return float(layers * per_layer + logits)
  return float(layers * tbd * bytes_per_element + per_layer + logits)


def estimate_comm(psi: float, devices: int, stage: int, *,
                  compute_dtype: Any = None, reduce_dtype: Any = None,
                  replica: int = 1,
                  replicated: float = 0) -> dict[str, dict[str, float]]:
  """Collectives of one step per device, by kind (analytic).

  Each collective is sized as the paper does, by the full array it works on
  (an all-gather's result, a reduce-scatter's input, an all-reduce's
  array): stage 0 all-reduces Ψ; stages 1-2 reduce-scatter Ψ and all-gather
  Ψ; stage 3 all-gathers 2Ψ (forward, and again in backward under per-layer
  remat) and reduce-scatters Ψ. A ring all-gather or reduce-scatter of E
  elements sends about E (N-1)/N per device and an all-reduce twice that,
  so the paper's volumes are 2Ψ, 2Ψ and 3Ψ (``comm_volume``).

  At stage 3 the 2Ψ all-gather is an upper bound: only parameters used
  inside ``scan_layers`` are gathered again in backward (embeddings and
  head once), and none with ``remat="none"``. ``replicated`` parameters
  are all-reduced instead. With ``replica`` R > 1, stages 1-3 also
  all-reduce each gradient shard (Ψ/N) over the R groups. Bytes follow
  ``ZeroConfig``: parameters are all-gathered in the compute dtype,
  gradients reduced (reduce-scatter, all-reduce) in the reduce dtype, fp32
  unless asked otherwise. (XLA's CPU backend runs 16-bit collectives in
  fp32, so there the measured bytes are 4 per element whatever the dtype.)

  Args:
    psi: parameter count Ψ.
    devices: devices in all.
    stage: ZeRO stage 0-3.
    compute_dtype: e.g. ``"bfloat16"``: the dtype of the parameter
      all-gathers; None for fp32.
    reduce_dtype: dtype gradients are summed in; None for fp32 (the
      ``ZeroConfig`` default, whatever the compute dtype).
    replica: replica groups R.
    replicated: parameters that stay replicated (see ``estimate_memory``).

  Returns:
    ``{kind: {"elements": ..., "bytes": ...}}`` with kinds named as in
    ``zero_jax.hlo.summarize``; kinds a stage does not use are left out.

  Raises:
    ValueError: as ``estimate_memory``.
  """
  _check_number("psi", psi, fix=_PSI_FIX)
  n = _data_axis(devices, replica)
  _check_stage(stage)
  sizes = {"all-gather": _compute_bytes(compute_dtype) or 4,
           "reduce-scatter": _compute_bytes(reduce_dtype) or 4,
           "all-reduce": _compute_bytes(reduce_dtype) or 4}
  r = _check_replicated(replicated, psi)
  s = psi - r
  if stage == 0:
    elements = {"all-reduce": psi}
  else:
    elements = {"reduce-scatter": s,
                "all-gather": 2 * s if stage == 3 else s,
                "all-reduce": r + (s / n if replica > 1 else 0)}
  out = {kind: {"elements": float(e), "bytes": float(e * sizes[kind])}
         for kind, e in elements.items() if e}
  _check_finite(f"estimate_comm(psi={psi!r})",
                {f"{kind} {unit}": v for kind, d in out.items()
                 for unit, v in d.items()})
  return out


def comm_volume(sizes: Mapping[str, float]) -> float:
  """The paper's communication volume: all-reduces count twice.

  Args:
    sizes: per kind, a full-array size (elements, bytes or multiples of Ψ),
      e.g. ``comm_in_psi(...)`` or ``{k: v["bytes"] for k, v in
      estimate_comm(...).items()}``.

  Returns:
    The sum, all-reduce weighted 2 (= reduce-scatter + all-gather).
  """
  return float(sum(v * (2 if kind == "all-reduce" else 1)
                   for kind, v in sizes.items()))


# ---------------------------------------------------------------- measured


def comm_in_psi(summary: Mapping[str, Mapping[str, int]], psi: float,
                n: int) -> dict[str, float]:
  """A measured ``zero_jax.hlo.summarize`` dict in multiples of Ψ.

  Uses ``estimate_comm``'s convention, the full array a collective works
  on: an all-gather's or all-reduce's result is full size, but a
  reduce-scatter's HLO result is the 1/n shard, so its elements are
  multiplied by ``n``. Other kinds (all-to-all, collective-permute) are
  taken as they are.

  Args:
    summary: ``zero_jax.hlo.summarize(compiled.as_text())``.
    psi: parameter count Ψ.
    n: devices of the axis the reduce-scatters run over (the ``data`` axis).

  Returns:
    ``{kind: elements / Ψ}``.

  Raises:
    ValueError: ``psi`` is not a finite number > 0, or ``n`` not an
      integer >= 1.
  """
  _check_number("psi", psi, fix=_PSI_FIX)
  _check_count("n", n, fix="pass the devices of the data axis")
  return {kind: d["elements"] * (n if kind == "reduce-scatter" else 1) / psi
          for kind, d in summary.items()}


def train_state_bytes(state: Any) -> dict[str, int]:
  """Per-device bytes of each field of a ``TrainState`` (measured).

  Every dataclass field is reported, so fields ``TrainState`` gains later
  (say a compute-dtype copy of the parameters) appear without a change here.

  Args:
    state: a ``TrainState`` of arrays, or of ``jax.ShapeDtypeStruct`` with
      shardings.

  Returns:
    ``{field name: bytes on the busiest device}``; the values sum to what
    the compiled step takes as its state.
  """
  if not dataclasses.is_dataclass(state) or isinstance(state, type):
    raise TypeError(f"expected a TrainState (a dataclass instance), got "
                    f"{type(state).__name__}")
  return {f.name: per_device_bytes(getattr(state, f.name))
          for f in dataclasses.fields(state)}
