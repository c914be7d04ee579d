"""Which ``ZeroConfig`` fields contradict each other across its sections
(each field already valid on its own, and each section's own rules
checked by the section): the checks of its construction that read fields
of more than one section."""

from __future__ import annotations

from typing import Any

from zero_jax.config._remat import RematPolicy, check_remat


def check_combinations(config: Any) -> None:
  """Raises ``ValueError`` naming the fields and the fix where ``config``'s
  fields contradict each other."""
  if config.loss_scale > 0 and config.compute_dtype != "float16":
    raise ValueError(
        "ZeroConfig.loss_scale only applies to compute_dtype='float16' "
        f"(got compute_dtype={config.compute_dtype!r}); bfloat16 and float32 "
        "have float32's range and need no loss scaling.")
  if config.offload_params and config.stage != 3:
    raise ValueError(
        f"ZeroConfig.offload_params needs stage=3 (got stage={config.stage}):"
        " only stage 3 shards the parameters it would stream per layer; "
        "at stages 1-2 use offload_optimizer='host' with a compute_dtype "
        "to offload the fp32 master.")
  if config.quantized_weights and config.stage != 3:
    raise ValueError(
        f"ZeroConfig.quantized_weights needs stage=3 (got stage="
        f"{config.stage}): only stage 3 all-gathers the parameters in the "
        "step; use stage=3, or quantized_weights=False.")
  stage2 = (config.stage == 2 and config.compute_dtype not in
            (None, "float32") and not config.offload_optimizer and
            config.update_on != "host")
  if config.prefetch is True and (
      (config.stage != 3 and not stage2) or
      check_remat(config.remat, config.remat_names) is not RematPolicy.FULL
      or config.offload_params or config.partition_activations):
    raise ValueError(
        "ZeroConfig.prefetch gathers scanned layers one layer ahead, at "
        "stage 3, or at stage 2 with a 16-bit compute dtype and the state "
        f"on the device, with remat='full' (got stage={config.stage}, "
        f"compute_dtype={config.compute_dtype!r}, offload_optimizer="
        f"{config.offload_optimizer!r}, update_on={config.update_on!r}, "
        f"remat={check_remat(config.remat, config.remat_names).value!r}, "
        f"offload_params={config.offload_params!r}, "
        f"partition_activations={config.partition_activations}): use "
        "stage=3 (or stage=2 with a compute_dtype and no offload), "
        "remat='full', no offload_params or partition_activations; or "
        "prefetch=False.")
  if config.hpz_partition_size > 1 and (
      config.stage != 3 or config.offload_params or config.offload_optimizer or
      config.prefetch is True):
    raise ValueError(
        f"ZeroConfig.hpz_partition_size={config.hpz_partition_size} (hpZ) "
        f"keeps a secondary copy of stage 3's gathered parameters (got "
        f"stage={config.stage}, offload_params={config.offload_params!r}, "
        f"offload_optimizer={config.offload_optimizer!r}, prefetch="
        f"{config.prefetch}): use stage=3 without offload or prefetch, or "
        "hpz_partition_size=1.")
  if config.loss_scope == "global":
    _check_global(config)
  elif config.accumulation == "whole_batch":
    raise ValueError(
        "ZeroConfig.accumulation='whole_batch' trains loss_fn on the whole "
        "global batch, which needs loss_scope='global' (got loss_scope="
        f"{config.loss_scope!r}, whose loss is per device): set "
        "loss_scope='global', or accumulation=None.")
  if config.quantized_gradients and config.stage == 0:
    raise ValueError(
        "ZeroConfig.quantized_gradients needs stage >= 1: stage 0 "
        "all-reduces whole gradients, which qgZ does not quantize; use "
        "stage 1-3, or quantized_gradients=False.")


def _check_global(config: Any) -> None:
  """Raises where ``loss_scope="global"`` meets a field it does not yet
  carry: naming the field and both fixes."""
  unsupported = {
      # (Stage 2's prefetch keeps each gathered layer for backward, by
      # collectives of the per-device step.)
      "prefetch": config.prefetch is True and config.stage != 3,
  }
  if config.quantized_gradients:
    # (qgZ quantizes each device's own gradient before the sum; with a
    # global loss the compiler sums each gradient where the matmul makes
    # it, so no device ever holds its own to quantize.)
    raise ValueError(
        "ZeroConfig.quantized_gradients (qgZ) quantizes each device's own "
        "gradient before it is summed; with loss_scope='global' the "
        "compiler sums gradients where the loss makes them, so there is "
        "none to quantize: use loss_scope='per_device' (the loss averaged "
        "over the devices' slices of the batch, DeepSpeed's meaning) for "
        "qgZ, or quantized_gradients=False.")
  asked = [name for name, on in unsupported.items() if on]
  if (config.compute_dtype in ("bfloat16", "float16")
      and config.reduce_dtype not in (None, config.compute_dtype)):
    # The compiler sums each gradient where its weight-gradient matmul
    # leaves it, in the compute dtype; the per-device step's float32 sums
    # of 16-bit gradients are its own collectives.
    raise ValueError(
        f"ZeroConfig.loss_scope='global' sums gradients across devices in "
        f"the compute dtype ({config.compute_dtype}), by the compiler's own "
        f"reduce-scatter, not in float32 (got reduce_dtype="
        f"{config.reduce_dtype!r}): leave reduce_dtype=None (the compute "
        "dtype) to accept that, compute_dtype=None for "
        "float32 throughout, or loss_scope='per_device', whose 16-bit "
        "gradients are summed in float32.")
  if asked:
    values = ", ".join(f"{n}={getattr(config, n)!r}" for n in asked)
    raise ValueError(
        f"ZeroConfig.loss_scope='global' does not yet run with {values}: "
        "leave those at their defaults for a loss with one device's "
        "meaning, or use loss_scope='per_device' (the loss averaged over "
        "the devices' slices of the batch, DeepSpeed's meaning).")

