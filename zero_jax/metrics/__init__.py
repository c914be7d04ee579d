"""Host-side training metrics: tokens/s, MFU, a progress bar, JSON-lines
logs.

Everything here runs on the host between steps; nothing is traced or
compiled. Values that come off devices are fetched with one
``jax.device_get`` per call, and only when they are written out.

Example::

  fpt = transformer_flops_per_token(n_params, n_layers, seq_len, d_model)
  meter = Throughput(global_batch * seq_len, flops_per_token=fpt,
                     peak=peak_flops(), num_devices=jax.device_count())
  with ProgressBar(num_steps, every=10) as bar, JsonlLogger("log.jsonl") as log:
    for step in range(1, num_steps + 1):
      state, out = engine.step(state, next(batches))
      jax.block_until_ready(out)           # the step has really finished
      meter.update()
      if step % 10 == 0 or step == num_steps:
        rates = meter.window()             # tokens/s, step_time, mfu
        log.log(step, loss=out["loss"], **rates)
        bar.update(step, loss=out["loss"], **rates)
"""

from zero_jax.metrics._progress import JsonlLogger, ProgressBar
from zero_jax.metrics._throughput import (Throughput, mfu, peak_flops,
                                          transformer_flops_per_token)

__all__ = [
    "JsonlLogger",
    "ProgressBar",
    "Throughput",
    "mfu",
    "peak_flops",
    "transformer_flops_per_token",
]
