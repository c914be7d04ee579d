"""Communication of one step per device: the analytic model and the
measured collectives in its terms.

``estimate_comm`` sizes each kind of collective of a stage as the paper
does; ``comm_volume`` turns such sizes into the paper's volume;
``comm_in_psi`` puts a measured ``zero_jax.analysis.summarize`` dict in the
same convention.
"""

from __future__ import annotations

from typing import Any, Mapping

from zero_jax._checks import check_finite, check_float, check_int
from zero_jax.analysis._inputs import (PSI_FIX, check_replicated, check_stage,
                                       compute_bytes, data_axis)


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
  unless asked otherwise. Where the reduce dtype is wider than a 16-bit
  compute dtype (the default), a sharded gradient crosses in the compute
  dtype instead, by an all-to-all, and is summed on its shard in the
  reduce dtype (``zero_jax.materialize``): the kind is ``"all-to-all"``,
  with the same elements and volume. (XLA's CPU backend runs 16-bit
  collectives in fp32, so there the measured bytes are 4 per element
  whatever the dtype.)

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
    ``zero_jax.analysis.summarize``; kinds a stage does not use are left out.

  Raises:
    ValueError: as ``estimate_memory``.
  """
  check_float("psi", psi, strict=True, fix=PSI_FIX)
  n = data_axis(devices, replica)
  check_stage(stage)
  reduce = compute_bytes(reduce_dtype, "reduce_dtype") or 4
  compute = compute_bytes(compute_dtype) or 4
  sizes = {"all-gather": compute, "reduce-scatter": reduce,
           "all-to-all": compute, "all-reduce": reduce}
  # 16-bit gradients summed wider cross as they are (see above).
  scatter = "all-to-all" if reduce > compute else "reduce-scatter"
  r = check_replicated(replicated, psi)
  s = psi - r
  if stage == 0:
    elements = {"all-reduce": psi}
  else:
    elements = {scatter: s,
                "all-gather": 2 * s if stage == 3 else s,
                "all-reduce": r + (s / n if replica > 1 else 0)}
  out = {kind: {"elements": float(e), "bytes": float(e * sizes[kind])}
         for kind, e in elements.items() if e}
  check_finite(f"estimate_comm(psi={psi!r})",
               {f"{kind} {unit}": v for kind, d in out.items()
                for unit, v in d.items()},
               "the inputs are too large to be real; check the parameter "
               "count")
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



def comm_in_psi(summary: Mapping[str, Mapping[str, int]], psi: float,
                n: int) -> dict[str, float]:
  """A measured ``zero_jax.analysis.summarize`` dict in multiples of Ψ.

  Uses ``estimate_comm``'s convention, the full array a collective works
  on: an all-gather's or all-reduce's result is full size, but a
  reduce-scatter's HLO result is the 1/n shard, so its elements are
  multiplied by ``n``. Other kinds (all-to-all, collective-permute) are
  taken as they are.

  Args:
    summary: ``zero_jax.analysis.summarize(compiled.as_text())``.
    psi: parameter count Ψ.
    n: devices of the axis the reduce-scatters run over (the ``data`` axis).

  Returns:
    ``{kind: elements / Ψ}``.

  Raises:
    ValueError: ``psi`` is not a finite number > 0, or ``n`` not an
      integer >= 1.
  """
  check_float("psi", psi, strict=True, fix=PSI_FIX)
  check_int("n", n, 1, fix="pass the devices of the data axis")
  return {kind: d["elements"] * (n if kind == "reduce-scatter" else 1) / psi
          for kind, d in summary.items()}
