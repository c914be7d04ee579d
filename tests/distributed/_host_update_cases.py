"""The configurations of the 2-process host-update run, shared by its
worker (``_host_update_worker.py``) and its test
(``test_host_update_multiprocess.py``), which cannot import the worker: the
worker starts JAX's distributed runtime as it is imported."""

STEPS = 3
# name: (optimizer: of tests/_models.py, or fused_ and one of FUSED, the
# mesh's devices per process, ZeroConfig fields).
CASES = {
    "stage0": ("adamw", 2, dict(stage=0)),
    "stage1": ("lion", 4, dict(stage=1)),
    # (Per device, as the case below.)
    "stage1_bf16_clip": ("adamw", 2, dict(stage=1, compute_dtype="bfloat16",
                                          clip_grad_norm=0.05,
                                          loss_scope="per_device")),
    "stage2_accum": ("clip_adam", 8, dict(stage=2, grad_accum_steps=2)),
    "stage3_clip": ("adamw", 2, dict(stage=3, clip_grad_norm=0.05)),
    # (The per-device loss, here and below: its float32 sums of 16-bit
    # gradients are the same in one process and two, where the compiler's
    # 16-bit sums of a global loss differ in order: by 2.2e-6 in this case
    # on jax 0.12.)
    "stage3_fp16": ("adamw", 4, dict(stage=3, compute_dtype="float16",
                                     loss_scope="per_device")),
    "stage3_bf16_delay": ("adamw", 2, dict(stage=3, compute_dtype="bfloat16",
                                           delay_update=True,
                                           loss_scope="per_device")),
    # The fused host optimizer: each process's shards in its own buffers.
    "fused_stage1_bf16": ("fused_adamw", 2, dict(
        stage=1, compute_dtype="bfloat16", clip_grad_norm=0.05,
        loss_scope="per_device")),
    "fused_stage3_delay": ("fused_lion", 4, dict(
        stage=3, compute_dtype="bfloat16", delay_update=True,
        loss_scope="per_device")),
    "fused_stage0": ("fused_adamw", 8, dict(stage=0)),
}
# The cases that also save, restore and export.
SAVED = ("stage1_bf16_clip", "stage3_fp16", "fused_stage1_bf16")


def make_tx(opt: str):
  """The optimizer a case names (``fused_``: zero_jax.offload's, at the
  rate of tests/_models.py's)."""
  # pylint: disable=g-import-not-at-top
  from tests import _models as m
  from zero_jax import offload
  # pylint: enable=g-import-not-at-top
  fused = {"fused_adamw": lambda: offload.adamw(1e-2, weight_decay=0.1),
           "fused_lion": lambda: offload.lion(1e-3)}
  return fused[opt]() if opt in fused else m.OPTIMIZERS[opt]()
