"""Memory per device: the paper's formula and zero_jax's analytic model.

The paper (arXiv:1910.02054, section 5) counts model-state bytes per device
for Ψ parameters on N devices, with 2-byte params and gradients and K bytes
of optimizer state per parameter (K = 12 for mixed-precision Adam). For fp32
training params and gradients are 4 bytes and K = 8 (Adam's two moments).
With model parallelism of degree M (the paper's MP, e.g. tensor parallelism
over ``zero_jax.make_mesh(model=M)``'s ``model`` axis) each device holds
the model states of Ψ/M parameters, which ZeRO shards over the data axis.

Three kinds of numbers, all exported by ``zero_jax.analysis``:

- the paper's formula (``paper_model_state_bytes``, ``paper_estimate``),
  here;
- an analytic model of zero_jax's *own* layouts (``estimate_memory``, here,
  which counts bytes by the engine's ``zero_jax.layout.Placement``;
  ``estimate_activations``, here; ``estimate_comm`` and ``comm_volume``, in
  ``_comm.py``), which differ from the paper's: no gradient buffer persists
  between steps, and with fp32 compute the replicated parameters of stages
  0-2 are also the master copy;
- measurements of a real engine (``compiled_memory``, ``per_device_bytes``,
  ``train_state_bytes``, in ``_measure.py``; ``comm_in_psi`` over
  ``summarize`` of the compiled HLO, in ``_comm.py``).

Example::

  est = estimate_memory(7.5e9, 64, 3, optimizer="adamw")
  est.model_states / 2**30            # GiB per device
  estimate_comm(7.5e9, 64, 3)         # {"all-gather": {...}, ...}
  # The paper's 1T model on 1024 GPUs, MP 16 x DP 64: 15.6 GB per device.
  paper_model_state_bytes(1e12, 64, 3, model_parallel=16) / 1e9
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zero_jax._checks import check_bool, check_finite, check_float, check_int
from zero_jax.analysis._inputs import (BYTES_FIX, PSI_FIX, check_replicated,
                                       check_stage, compute_bytes, data_axis)
from zero_jax.config import ZeroConfig
from zero_jax.layout import ComputeCopy, Placement, decide_placement


def paper_model_state_bytes(psi: float, n: int, stage: int, *,
                            param_bytes: int = 2, grad_bytes: int = 2,
                            k: int = 12, model_parallel: int = 1) -> float:
  """Per-device model-state bytes of the ZeRO paper's formula.

  The defaults are the paper's accounting (its Table 1, in GB = 1e9 bytes):
  mixed-precision Adam, 2Ψ fp16 parameters + 2Ψ fp16 gradients + 12Ψ
  optimizer state (fp32 master, momentum and variance), each of the three
  divided by N where the stage shards it. With ``model_parallel=M`` each
  device holds Ψ/M of it first: the paper's 1T-parameter model on 1024 GPUs
  as MP 16 x DP 64 is ``paper_model_state_bytes(1e12, 64, 3,
  model_parallel=16)``, 15.6 GB.

  Args:
    psi: parameter count Ψ.
    n: data-parallel devices N (the DP degree; the devices in all are
      N x ``model_parallel``).
    stage: 0 (plain DP), 1 (P_os), 2 (P_os+g), 3 (P_os+g+p).
    param_bytes: bytes per parameter (2 for fp16/bf16 compute, 4 for fp32).
    grad_bytes: bytes per gradient element.
    k: optimizer-state bytes per parameter (12 for mixed-precision Adam,
      8 for fp32 Adam).
    model_parallel: model-parallel degree M (the paper's MP): devices that
      split each data-parallel rank's copy of the model.

  Returns:
    Bytes per device.

  Raises:
    ValueError: a size is not finite, or negative (Ψ and N also not 0), the
      stage is not 0-3, or ``model_parallel`` is not an int >= 1.
  """
  _check_paper_args(psi, n, stage, param_bytes, grad_bytes, k,
                    model_parallel)
  psi = _per_rank(psi, model_parallel)
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

@dataclasses.dataclass(frozen=True)
class Estimate:
  """Bytes per device of one training setup, by kind.

  Attributes:
    params: every parameter copy kept between steps: the fp32 master, plus,
      at stages 1-2 with a 16-bit compute dtype, the replicated compute copy
      (at stage 2 with ``ZeroConfig.prefetch`` there is none between
      steps, but forward gathers the parameters whole in that dtype and
      backward reads them: counted as the replicated copy).
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


def _check_paper_args(psi: float, n: int, stage: int, param_bytes: float,
                      grad_bytes: float, k: float,
                      model_parallel: int) -> None:
  """The checks shared by the paper's formula and its split."""
  check_float("psi", psi, strict=True, fix=PSI_FIX)
  check_int("n", n, 1, fix="pass the data-parallel devices N (the DP "
            "degree, without the model-parallel devices)")
  check_stage(stage)
  check_float("param_bytes", param_bytes, fix=BYTES_FIX)
  check_float("grad_bytes", grad_bytes, fix=BYTES_FIX)
  check_float("k", k, fix="pass optimizer-state bytes per parameter, e.g. 12")
  _check_model_parallel(model_parallel)


_MP_FIX = ("pass the model-parallel degree M, the devices that split each "
           "data-parallel rank's copy of the model (1: none)")


def _check_model_parallel(model_parallel: Any) -> int:
  """``model_parallel`` as a Python int >= 1."""
  return check_int("model_parallel", model_parallel, 1, fix=_MP_FIX)


def _per_rank(psi: float, model_parallel: int) -> float:
  """Ψ/M, the parameters of one model rank; Ψ itself (an int stays one)
  without model parallelism, so that those results are as before."""
  return psi if model_parallel == 1 else psi / model_parallel


def _data_devices(devices: int, replica: int, model_parallel: int) -> int:
  """The ``data`` axis N = devices // (replica * model_parallel)."""
  n = data_axis(devices, replica)
  model_parallel = _check_model_parallel(model_parallel)
  if n % model_parallel:
    raise ValueError(
        f"devices={devices} is not divisible by replica={replica} x "
        f"model_parallel={model_parallel} = {replica * model_parallel}: "
        "each data-parallel rank is a group of model_parallel devices, and "
        "the data axis gets devices // (replica * model_parallel); choose a "
        "model_parallel (and replica) whose product divides devices")
  return n // model_parallel


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
    return check_float("k", k, fix="pass optimizer-state bytes per "
                       "parameter, e.g. 8 for fp32 Adam")
  if optimizer not in OPTIMIZER_STATE_BYTES:
    raise ValueError(f"unknown optimizer {optimizer!r}; known: "
                     f"{sorted(OPTIMIZER_STATE_BYTES)} (or pass k=bytes per "
                     "parameter)")
  return OPTIMIZER_STATE_BYTES[optimizer]


def _unplaced(pl: Placement, c: int | None) -> tuple[bool, bool, int]:
  """What ``Placement`` does not record, derived here from its stage.

  Returns whether the optimizer state is sharded (stages 1-3: ZeRO's
  P_os), whether the gradients live at the update as reduce-scattered
  shards (stages 2-3: P_os+g; at stages 0-1 backward leaves them whole),
  and their bytes per element: the compute dtype's ``c`` where there is one,
  but fp32 at stage 3, where they are the master's.
  """
  grad_bytes = 4 if c is None or pl.stage == 3 else c
  return pl.stage >= 1, pl.stage >= 2, grad_bytes


def estimate_memory(psi: float, devices: int, stage: int, *,
                    optimizer: str = "adamw", k: float | None = None,
                    compute_dtype: Any = None, replica: int = 1,
                    model_parallel: int = 1,
                    activations: float | None = None,
                    replicated: float = 0, offload_optimizer: bool = False,
                    offload_params: bool = False,
                    update_on: str = "device") -> Estimate:
  """Per-device bytes of zero_jax's layouts for Ψ parameters (analytic).

  N = ``devices // (replica * model_parallel)`` is the ``data`` axis state
  is sharded over; the ``replica`` groups each hold a full set of shards.
  (With hpZ, ``ZeroConfig.hpz_partition_size``, state is sharded over
  every device: pass ``replica=1``. Its secondary copy, cΨ/K per device
  for groups of K, lives during the step, like activations.)
  With ``model_parallel=M`` (``zero_jax.make_mesh(model=M)``) each device
  holds the model states of Ψ/M parameters, its model rank's slice, and the
  table below applies with Ψ/M for Ψ: every figure is 1/M of the one for
  ``devices // M`` devices without model parallelism. (The ideal split: a
  model that keeps some parameters whole on every model rank holds more.)
  K is the optimizer-state bytes per parameter. With fp32 training (no
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
    model_parallel: model-parallel degree M: devices that split the model
      itself (tensor parallelism over the mesh's ``model`` axis);
      ``devices`` must be divisible by ``replica * model_parallel``.
    activations: activation bytes per device to add (e.g. from
      ``estimate_activations``); None for 0. Added as given: with model
      parallelism pass the figure of one device of its group.
    replicated: parameters that stay replicated whatever the stage (leaves
      below ``min_shard_elements`` or with no dimension divisible by N; see
      ``Engine.describe()``). 0 gives the ideal layout; the count makes the
      estimate match a real engine to the byte, up to scalars such as
      Adam's step count. With ``model_parallel`` M, those among the Ψ/M
      parameters of one model rank (at most Ψ/M).
    offload_optimizer: ``ZeroConfig(offload_optimizer="host")``.
    offload_params: ``ZeroConfig(offload_params="host")`` (stage 3).
    update_on: ``ZeroConfig.update_on``: ``"host"`` keeps master and
      optimizer state on the host and a compute copy (float32 in fp32
      training) on the device.

  Returns:
    The estimate.

  Raises:
    ValueError: ``psi`` or ``devices`` is not finite or not > 0,
      ``replica`` or ``model_parallel`` is not an int >= 1, ``replica *
      model_parallel`` does not divide ``devices``, ``activations`` or
      ``replicated`` is negative or not finite (or ``replicated`` > ``psi``),
      or the options make an invalid ``ZeroConfig`` (its message names the
      field).
  """
  check_float("psi", psi, strict=True, fix=PSI_FIX)
  n = _data_devices(devices, replica, model_parallel)
  check_stage(stage)
  kb = optimizer_state_bytes(optimizer, k)
  c = compute_bytes(compute_dtype)
  r = check_replicated(replicated, psi)
  # Each device's model states are those of its model rank's Ψ/M. (Ψ as
  # given without model parallelism: an int Ψ keeps its exact products.)
  psi_rank = _per_rank(psi, model_parallel)
  if r > psi_rank:
    raise ValueError(
        f"replicated={replicated!r} exceeds the psi / model_parallel = "
        f"{psi_rank!r} parameters of one model rank: with model_parallel="
        f"{model_parallel} it counts those of one rank's slice that stay "
        "whole; pass at most psi / model_parallel")
  if activations is not None:
    check_float("activations", activations,
                fix="pass activation bytes per device (e.g. from "
                "estimate_activations), or None")
  offload_optimizer = check_bool(
      "offload_optimizer", offload_optimizer,
      "True stands for ZeroConfig(offload_optimizer='host')")
  offload_params = check_bool(
      "offload_params", offload_params,
      "True stands for ZeroConfig(offload_params='host')")
  full = lambda b: b * psi_rank
  sharded = lambda b: b * ((psi_rank - r) / n + r)
  if offload_params and stage != 3:
    raise ValueError(f"offload_params needs stage 3, got stage={stage}: only "
                     "stage 3 shards the parameters it would stream; at "
                     "stages 1-2 pass offload_optimizer=True with a "
                     "compute_dtype to offload the fp32 master")
  # Where master, moments and the compute copy live: the engine's rules.
  # (Only whether a 16-bit copy exists matters to the layout; c sizes it.)
  pl = decide_placement(ZeroConfig(
      stage=stage, compute_dtype=None if c is None else "bfloat16",
      offload_optimizer="host" if offload_optimizer else None,
      offload_params="host" if offload_params else None,
      update_on=update_on))
  opt_sharded, grads_sharded, grad_bytes = _unplaced(pl, c)
  master = sharded(4) if pl.master_sharded else full(4)
  # (With update_on="host" the device's copy is float32 in fp32 training.)
  cc = c or pl.copy_dtype.itemsize
  compute = {ComputeCopy.REPLICATED: full(cc), ComputeCopy.SHARDED: sharded(cc),
             None: 0.0}[pl.compute_copy]
  if pl.keeps_gathered:
    # Stage 2 with prefetch: no copy between steps, but forward gathers
    # the parameters whole and backward reads them, as the replicated copy
    # is held.
    compute = full(cc)
  opt_state = sharded(kb) if opt_sharded else full(kb)
  grads = sharded(grad_bytes) if grads_sharded else full(grad_bytes)
  host = ((master if pl.master_on_host else 0.0) +
          (opt_state if pl.opt_on_host else 0.0))
  if pl.compute_memory.on_host:
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
  check_finite(f"estimate_memory(psi={psi!r}, k={kb!r})",
               dataclasses.asdict(est) | {"total": est.total},
               "the inputs are too large to be real; check the parameter "
               "count and bytes per parameter")
  return est


def paper_estimate(psi: float, n: int, stage: int, *, param_bytes: int = 2,
                   grad_bytes: int = 2, k: float = 12,
                   model_parallel: int = 1) -> Estimate:
  """The paper's formula (``paper_model_state_bytes``), split by kind.

  Args:
    psi: parameter count Ψ.
    n: data-parallel devices N (the DP degree).
    stage: 0-3.
    param_bytes: bytes per parameter (2 for mixed precision, 4 for fp32).
    grad_bytes: bytes per gradient element.
    k: optimizer-state bytes per parameter (12 for mixed-precision Adam:
      fp32 master + two moments; 8 for fp32 Adam).
    model_parallel: model-parallel degree M: each device counts Ψ/M.

  Returns:
    The estimate (no activations: the paper counts model states).

  Raises:
    ValueError: as ``paper_model_state_bytes``.
  """
  _check_paper_args(psi, n, stage, param_bytes, grad_bytes, k,
                    model_parallel)
  psi = _per_rank(psi, model_parallel)
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
    check_int(name, value, 1, fix="pass the model's shape")
  check_int("vocab", vocab, 0, fix="pass the vocabulary size, or 0 to "
            "leave the logits out")
  check_float("bytes_per_element", bytes_per_element, strict=True,
              fix=BYTES_FIX)
  if not isinstance(remat, str) or remat not in ("full", "none"):
    raise ValueError(f"remat must be 'full' or 'none', got {remat!r}")
  tbd = seq_len * micro_batch * hidden
  per_layer = (tbd * (34 + 5 * heads * seq_len / hidden) *
               bytes_per_element / 2)
  logits = 2 * micro_batch * seq_len * vocab * bytes_per_element
  if remat == "none":
    return float(layers * per_layer + logits)
  return float(layers * tbd * bytes_per_element + per_layer + logits)


