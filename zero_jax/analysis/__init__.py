"""Analysis: what a ZeRO layout costs each device, estimated and measured.

- analytic models of memory and communication per stage
  (``estimate_memory``, an ``Estimate``; ``estimate_comm``,
  ``estimate_activations``) next to the paper's formula
  (``paper_model_state_bytes``);
- measurements of a real or compiled step (``compiled_memory``,
  ``per_device_bytes``, ``param_count``, ``train_state_bytes``; the
  collectives of its HLO text: ``collectives``, ``summarize``,
  ``sent_across_nodes``; the bytes it moves between host and device memory:
  ``host_transfers``);
- compiling the train step for NVIDIA GPUs without one (``gpu_mesh``,
  ``gpu_devices`` of the ``TARGETS``, ``compile_step``, ``abstract_batch``,
  and the GSPMD FSDP peer of a step:
  ``compile_gspmd_step``; the reference GPT's are ``zero_jax.models``'
  ``compile_gpt`` and ``compile_gspmd_gpt``) and which of a compiled GPU
  program's asynchronous collectives overlap a gemm (``overlap``,
  ``overlap_summary``). Ask for the GPUs before anything touches JAX's
  devices: without a GPU, JAX's CUDA plugin starts only with
  ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` set, which ``gpu_mesh`` sets then
  (importing this package sets nothing);
- the command line ``python -m zero_jax.estimate`` (``main``, handed
  ``zero_jax.models`` to compile the reference GPT).
"""

from zero_jax._devices import device_memory
from zero_jax.analysis._aot import (TARGETS, CompiledStep, abstract_batch,
                                    compile_step, gpu_devices, gpu_mesh)
from zero_jax.analysis._cli import main
from zero_jax.analysis._comm import comm_in_psi, estimate_comm
from zero_jax.analysis._gspmd import compile_gspmd_step
from zero_jax.analysis._hlo import (Collective, collectives,
                                    sent_across_nodes, summarize)
from zero_jax.analysis._measure import (CompiledMemory, compiled_memory,
                                        param_count, per_device_bytes,
                                        train_state_bytes)
from zero_jax.analysis._memory import (Estimate, estimate_activations,
                                       estimate_memory,
                                       paper_model_state_bytes)
from zero_jax.analysis._overlap import (AsyncCollective, OverlapCount,
                                        overlap, overlap_summary)
from zero_jax.analysis._transfers import Transfers, host_transfers

__all__ = [
    "AsyncCollective",
    "Collective",
    "CompiledMemory",
    "CompiledStep",
    "Estimate",
    "OverlapCount",
    "TARGETS",
    "Transfers",
    "abstract_batch",
    "collectives",
    "comm_in_psi",
    "compile_gspmd_step",
    "compile_step",
    "compiled_memory",
    "device_memory",
    "estimate_activations",
    "estimate_comm",
    "estimate_memory",
    "gpu_devices",
    "gpu_mesh",
    "host_transfers",
    "main",
    "overlap",
    "overlap_summary",
    "paper_model_state_bytes",
    "param_count",
    "per_device_bytes",
    "sent_across_nodes",
    "summarize",
    "train_state_bytes",
]
