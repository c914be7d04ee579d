"""The configurations of the 2-process host-update run, shared by its
worker (``_host_update_worker.py``) and its test
(``test_host_update_multiprocess.py``), which cannot import the worker: the
worker starts JAX's distributed runtime as it is imported."""

STEPS = 3
# name: (optimizer of tests/_models.py, the mesh's devices per process,
# ZeroConfig fields).
CASES = {
    "stage0": ("adamw", 2, dict(stage=0)),
    "stage1": ("lion", 4, dict(stage=1)),
    # (Per device, as the case below.)
    "stage1_bf16_clip": ("adamw", 2, dict(stage=1, compute_dtype="bfloat16",
                                          clip_grad_norm=0.05,
                                          loss_scope="per_device")),
    "stage2_accum": ("clip_adam", 8, dict(stage=2, grad_accum_steps=2)),
    "stage3_clip": ("adamw", 2, dict(stage=3, clip_grad_norm=0.05)),
    "stage3_fp16": ("adamw", 4, dict(stage=3, compute_dtype="float16")),
    # (The per-device loss: its float32 sums of bf16 gradients are the
    # same in one process and two, where the compiler's bf16 sums of a
    # global loss differ in order.)
    "stage3_bf16_delay": ("adamw", 2, dict(stage=3, compute_dtype="bfloat16",
                                           delay_update=True,
                                           loss_scope="per_device")),
}
# The cases that also save, restore and export.
SAVED = ("stage1_bf16_clip", "stage3_fp16")
