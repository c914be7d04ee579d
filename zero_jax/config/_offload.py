"""``ZeroConfig.offload``: where offloaded state lives and where its update
runs (ZeRO-Offload, ZeRO-Infinity), and the rules between those fields."""

from __future__ import annotations

import dataclasses

from zero_jax._checks import check_bool, check_choice, check_str
from zero_jax.config._nvme import NvmeOptions
from zero_jax.config._sections import Section, Tier, UpdateOn


@dataclasses.dataclass(frozen=True)
class Offload(Section):
  """Offloaded state and where its update runs.

  Attributes:
    optimizer: ``"host"`` (``Tier.HOST``) keeps the optimizer state in
      pinned host memory between steps, and the fp32 master parameters too
      wherever forward reads a separate compute-dtype copy (stages 1-2
      with a compute dtype; stage 3 with a compute dtype keeps a sharded
      compute copy on the device for that). None keeps both on the device.
      ``"nvme"`` (ZeRO-Infinity; with ``update="host"`` and an optimizer
      of ``zero_jax.offload``) keeps the fp32 master and the optimizer
      state in files under ``nvme_path``, read, updated and written a
      slice at a time, and crash-consistent: docs/offload.md.
    params: stage 3 only. ``"host"`` keeps the fp32 master shards in
      pinned host memory; forward and backward copy each layer's shards to
      the device just before gathering them (inside ``scan_layers``). At
      stage 3, whenever forward gathers from something other than the
      device master (this option, or ``optimizer`` with a compute dtype)
      and there is one micro-batch per step, the gradient shards of the
      leaves the update streams also go to host memory as backward makes
      them (ZeRO-Offload), and the update reads them back a slice at a
      time.
    update: where the optimizer update runs when state is offloaded:
      ``"device"`` (the default) streams the offloaded state through the
      device a slice at a time (a loop over the layer axis of stacked
      leaves, and rows of other large leaves: ``zero_jax.offload``), so the
      device holds a few slices of master and moments, never all of them.
      Exact for updates that keep rows and leaves apart (adam, adamw, lion,
      sgd, adafactor); a global norm in ``tx`` is an error that names
      ``clip_grad_norm``. ``"host"`` is ZeRO-Offload's split
      (``zero_jax.offload``): master and optimizer state live in host RAM
      on this process's CPU devices, a program of their own updates them
      there with every core, and only gradients (down) and the compute
      copy (up) cross to the device, which holds the compute copy,
      gradients and activations: 6 bytes a parameter per step with bf16
      compute, 4 with a bfloat16 reduce dtype. Give JAX one CPU device per
      core (``zero_jax.simulate_cpu_devices`` or
      ``jax.config.update("jax_num_cpu_devices", os.cpu_count())`` before
      JAX starts). Any optax chain is exact.
    delay: with ``update="host"``, DeepSpeed's one-step delayed parameter
      update: each step's forward and backward read the parameters from
      before the previous step's update (the first step after ``init`` or
      a restore reads the current ones), so the host updates step t while
      the device computes step t+1. This changes the math: every gradient
      is applied one update late. It hides the host update's time; the
      device briefly holds two compute copies.
    nvme_path: with ``optimizer="nvme"``, the directory (on a fast local
      disk) under which each process keeps its files.
    nvme: the NVMe tier's ``NvmeOptions`` (slices, RAM budget, I/O).
  """

  NAME = "offload"
  SHORTHAND = {"optimizer": "offload_optimizer", "params": "offload_params",
               "update": "update_on", "delay": "delay_update",
               "nvme_path": "nvme_path", "nvme": "nvme"}

  optimizer: Tier | None = None
  params: Tier | None = None
  update: UpdateOn = UpdateOn.DEVICE
  delay: bool = False
  nvme_path: str | None = None
  nvme: NvmeOptions = NvmeOptions()

  def __post_init__(self):
    self._check_fields()
    self._check_rules()

  def _check_fields(self) -> None:
    """Checks each field on its own."""
    if self.optimizer == "disk":
      self._fail("optimizer", "None, 'host' or 'nvme'",
                "'nvme' keeps the optimizer state in files under nvme_path.")
    self._check("optimizer", check_choice, (None, "host", "nvme"),
               "use 'host' to keep the optimizer state in host memory, "
               "'nvme' in files under nvme_path, None on the device.")
    if self.params == "nvme":
      self._fail("params", "None or 'host'",
                "parameters on NVMe are not implemented (the optimizer "
                "state's tier is: offload_optimizer='nvme'); use 'host' for "
                "the fp32 master shards in host memory.")
    self._check("params", check_choice, (None, "host"),
               "use 'host' (stage 3) to keep the fp32 master shards in host "
               "memory, None to keep them on the device.")
    self._check("update", check_choice, ("device", "host"),
               "'device' streams offloaded state through the device, 'host' "
               "updates it on the host's CPU devices.")
    self._check("delay", check_bool,
               "True (with update_on='host') applies each update one step "
               "late.")
    for name, kind in (("optimizer", Tier), ("params", Tier),
                       ("update", UpdateOn)):
      if getattr(self, name) is not None:
        self._set(name, kind(getattr(self, name)))
    try:
      self._set("nvme", NvmeOptions.of(self.nvme))
    except ValueError as e:
      raise ValueError(f"{self._label('nvme')}={self.nvme!r} is not valid: "
                       f"{e}") from e
    fix = "name a directory on a fast local disk (each process writes in it)"
    if self.nvme_path is not None:
      self._check("nvme_path", check_str, fix)
      if not self.nvme_path.strip():
        self._fail("nvme_path", "a directory", fix)

  def _check_rules(self) -> None:
    """Raises where the fields contradict each other."""
    if self.delay and self.update is not UpdateOn.HOST:
      raise ValueError("ZeroConfig.delay_update overlaps the host's update "
                       "with the next step: set update_on='host' (and "
                       "offload_optimizer='host') too")
    nvme = self.optimizer is Tier.NVME
    if nvme and self.nvme_path is None:
      raise ValueError(
          "ZeroConfig.offload_optimizer='nvme' (NVMe offload) keeps the "
          "optimizer state in files; set nvme_path to a directory on a fast "
          "local disk")
    if self.nvme_path is not None and not nvme:
      raise ValueError(
          f"ZeroConfig.nvme_path={self.nvme_path!r} is read only with "
          f"offload_optimizer='nvme' (got {self.optimizer!r}): set "
          "offload_optimizer='nvme', or leave nvme_path None")
    if nvme and self.update is not UpdateOn.HOST:
      raise ValueError(
          "ZeroConfig.offload_optimizer='nvme' updates the state on the "
          "host, a slice at a time between disk and RAM: set "
          "update_on='host' too")
    if self.update is UpdateOn.HOST and not (self.optimizer or self.params):
      raise ValueError("ZeroConfig.update_on='host' runs the update where "
                       "offloaded state lives: set offload_optimizer='host' "
                       "or offload_params='host' too")
