"""Compile the real train step for GPUs you do not have.

JAX compiles for NVIDIA GPUs on any machine once the CUDA plugin is
installed (``pip install "zero-jax[gpu-compile]"``): ``jax.experimental.
topologies`` describes N devices of a named GPU, and a step lowered from
shapes alone compiles for them. Nothing is materialised, so a 70B model
compiles on a laptop. The compiled program is what a GPU user runs: its
``memory_analysis()`` is the device's memory (within 1-2% of a real H100's
peak) and its HLO holds the collectives with their real dtypes. On a
CPU-compiled step both differ: 16-bit collectives are upcast, another
scheduler orders the gathers, host offload moves nothing.

Example::

  from zero_jax import analysis

  mesh = analysis.gpu_mesh("h100", 8)
  engine = zj.Engine(loss_fn, optax.adamw(1e-4), zj.ZeroConfig(stage=3),
                     mesh)
  report = analysis.compile_step(engine, param_shapes, batch_shapes)
  print(report.memory.peak / 2**30, report.memory.host)
  report.collectives[("all-gather", "bf16")]["bytes"]

Only time and what XLA decides at run time (autotuning) need the real GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from typing import Any

import jax
import numpy as np

from zero_jax._compat import backends_started
from zero_jax._devices import record_spec_memory
from zero_jax.analysis import _hlo as hlo
from zero_jax.analysis import _measure as measure
from zero_jax.analysis import _transfers as transfers_
from zero_jax.layout import UpdateKind, make_mesh

# No driver is needed to compile, but without this variable the CUDA plugin
# refuses to start where it cannot check the CUDA libraries against one (a
# machine without a GPU), and then JAX describes no GPU. The plugin reads it
# once, when JAX's backends start. ``gpu_devices`` sets it, where it still
# takes effect; importing the library leaves the environment (and the check
# on real GPUs) alone.
_SKIP_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"

# Target name -> spec file shipped in analysis/gpu_specs (GpuTargetConfigProto
# text from XLA's public specs, trimmed to what jaxlib 0.10-0.12 accept).
TARGETS = {"h100": "h100.txtpb", "h200": "h200.txtpb",
           "a100-80gb": "a100-80gb.txtpb"}
_SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "gpu_specs")
INSTALL_HINT = ('pip install "zero-jax[gpu-compile]" (from a checkout: pip '
                'install -e ".[gpu-compile]"), or pip install '
                f'"jax[cuda12]=={jax.__version__}"')


def target_spec(target: str) -> str:
  """The ``GpuTargetConfigProto`` text of a target in ``TARGETS``.

  Raises:
    ValueError: an unknown target (the message lists the known ones).
  """
  if target not in TARGETS:
    raise ValueError(f"unknown GPU target {target!r}; known targets: "
                     f"{', '.join(sorted(TARGETS))}")
  with open(os.path.join(_SPECS, TARGETS[target]), encoding="utf-8") as f:
    return f.read()


def gpu_devices(target: str = "h100", count: int = 8) -> list[jax.Device]:
  """``count`` compile-only devices of a GPU in ``TARGETS``, on one host.

  On a machine without a GPU, the CUDA plugin starts only with
  ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` set when JAX's backends start: this
  sets it (``1``) if they have not started yet, and leaves it alone
  otherwise. Call it (or ``gpu_mesh``) before anything touches JAX's
  devices, set the variable before Python starts, or run with
  ``JAX_PLATFORMS=cpu`` (which needs no variable).

  Args:
    target: ``"h100"``, ``"h200"`` or ``"a100-80gb"``.
    count: number of devices.

  Returns:
    Devices that compile but cannot run anything.

  Raises:
    ValueError: an unknown target, or ``count < 1``.
    ImportError: the CUDA plugin is missing, or does not match the installed
      jax (the message names the install).
    RuntimeError: JAX's backends started without the variable, before this
      call, and the plugin refused to start (the message names the fixes).
  """
  spec = target_spec(target)
  if isinstance(count, bool) or not isinstance(count, int) or count < 1:
    raise ValueError(f"count must be a positive int, got {count!r}")
  if importlib.util.find_spec("jax_cuda12_plugin") is None:
    raise ImportError(f"compiling for {target} needs JAX's CUDA plugin, "
                      f"which is not installed: {INSTALL_HINT}")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  started = backends_started()
  if not started:
    # Where it still takes effect; a value the user set is theirs. (Unknown:
    # set too, which does no harm if they have started.)
    os.environ.setdefault(_SKIP_CHECK, "1")
  try:
    topo = topologies.get_topology_desc(
        platform="cuda", topology=f"1x1x{count}", target_config=spec)
  except NotImplementedError as e:
    if started is not False or not os.environ.get(_SKIP_CHECK):
      raise RuntimeError(
          f"JAX's CUDA plugin did not start ({e}), so it cannot describe "
          f"{target} devices: JAX's backends started with {_SKIP_CHECK} "
          "unset (something touched JAX devices first, e.g. jax.devices()), "
          "and on a machine without a GPU the plugin starts only with it "
          "set; it is read once, when they start. Set "
          f"{_SKIP_CHECK}=1 in the environment before starting Python, or "
          "call zero_jax.analysis.gpu_mesh()/gpu_devices() before anything "
          "touches JAX devices, or run with JAX_PLATFORMS=cpu") from e
    raise ImportError(
        f"JAX's CUDA plugin did not start ({e}) although {_SKIP_CHECK} was "
        f"set before JAX's backends started; it must match jax "
        f"{jax.__version__}: {INSTALL_HINT}") from e
  except Exception as e:  # pylint: disable=broad-except
    raise ImportError(
        f"JAX's CUDA plugin could not describe {count} {target} devices "
        f"({type(e).__name__}: {e}); it must match jax {jax.__version__}: "
        f"{INSTALL_HINT}") from e
  memory = re.search(r"device_memory_size:\s*(\d+)", spec)
  for d in topo.devices:
    if memory:
      record_spec_memory(d, int(memory.group(1)))
  return list(topo.devices)


def gpu_mesh(target: str = "h100", devices: int = 8, *,
             replica: int = 1, model: int = 1) -> jax.sharding.Mesh:
  """A ``make_mesh`` mesh of ``devices`` compile-only GPUs of ``target``.

  Engines built on it place offloaded state in ``pinned_host`` as they do on
  real GPUs (their shardings are built on the abstract mesh), and their
  step compiles with ``compile_step``. Like ``gpu_devices`` (whose errors it
  raises), call it before anything touches JAX's devices.
  """
  return make_mesh(devices=gpu_devices(target, devices), replica=replica,
                   model=model)


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """What one compiled train step costs each device.

  Attributes:
    memory: device bytes (argument, output, temp, alias, ``peak``) and the
      host (``pinned_host``) bytes of offloaded state (``host``).
    collectives: per step, ``{(kind, dtype): {"count", "elements",
      "bytes"}}`` with HLO dtype names (``"bf16"``, ``"f32"``); loops are
      counted with their trip counts.
    hlo: the compiled program's HLO text.
    params: Ψ, the parameters of the model compiled.
    transfers: host <-> device bytes per step and device (offload's PCIe
      traffic): what the program moves (``host_transfers``), and with
      ``update_on="host"`` also what the step moves around it (the
      gradients it returns in device memory go to the host's update, the
      new compute copy comes back).
  """

  memory: measure.CompiledMemory
  collectives: dict[tuple[str, str], dict[str, int]]
  hlo: str
  params: int
  transfers: transfers_.Transfers = transfers_.Transfers(0, 0)

  def transfer_bytes_per_param(self) -> float:
    """Both directions' bytes per step over Ψ (per device: at N devices,
    Ψ/N of them cross each device's link)."""
    return self.transfers.total / self.params

  def collective_bytes(self, kind: str) -> int:
    """Bytes per step of one kind of collective, all dtypes."""
    return sum(d["bytes"] for (k, _), d in self.collectives.items()
               if k == kind)


def abstract_batch(engine, batch: Any) -> Any:
  """``batch`` (arrays or ``jax.ShapeDtypeStruct``, leading dimension the
  global batch) as shapes laid out as ``engine.step`` lays them out."""
  # (The step checks the batch size as it traces.)
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                     sharding=engine.batch_sharding), batch)


def compile_step(engine, params: Any, batch: Any) -> CompiledStep:
  """Compiles ``engine``'s train step from shapes and reads off its costs.

  Works on any mesh: compile-only GPUs (``gpu_mesh``) or real devices.

  Args:
    engine: a ``zero_jax.Engine`` (``init`` need not have been called).
    params: the parameters or only their shapes (``jax.ShapeDtypeStruct``,
      e.g. from ``jax.eval_shape``), in the tree ``init`` would take.
    batch: a global batch, or its shapes.

  Returns:
    The ``CompiledStep``.
  """
  state = engine.abstract_state(params)
  batch = abstract_batch(engine, batch)
  with jax.set_mesh(engine.mesh):
    compiled = engine.step.lower(state, batch).compile()
  text = compiled.as_text()
  moved = transfers_.host_transfers(text)
  if engine.placement.update is UpdateKind.HOST:
    # The device's program returns the gradients (those it did not send to
    # host memory itself go now) and is given the compute copy the host's
    # update made.
    moved = moved + transfers_.Transfers(
        to_device=measure.per_device_bytes(state.compute_params),
        to_host=transfers_.device_outputs_bytes(text))
  return CompiledStep(memory=measure.compiled_memory(compiled),
                      collectives=hlo.summarize_by_dtype(text), hlo=text,
                      params=measure.param_count(params), transfers=moved)

