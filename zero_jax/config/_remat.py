"""Rematerialization policies by name: ``RematPolicy``, what
``ZeroConfig.remat`` holds. (The ``jax.checkpoint`` policy each stands for
is ``zero_jax.layers.remat_policy``.)"""

from __future__ import annotations

import dataclasses
import enum

from zero_jax._checks import check_bool, check_int
from zero_jax.config._sections import Section


class RematPolicy(str, enum.Enum):
  """What each layer keeps of forward for backward, by name.

  A ``str`` enum, as MaxText's: ``ZeroConfig(remat="full")`` and
  ``ZeroConfig(remat=RematPolicy.FULL)`` are the same config. None of the
  policies saves gathered parameters: saving them would keep every layer's
  full parameters alive until backward (stage 2 memory at stage 3).
  """

  NONE = "none"
  FULL = "full"
  DOTS_SAVEABLE = "dots_saveable"
  ATTENTION_SAVEABLE = "attention_saveable"
  DOTS_ATTENTION_SAVEABLE = "dots_attention_saveable"
  SAVE_ONLY_NAMED = "save_only_named"
  OFFLOAD_TO_HOST = "offload_to_host"
  AUTO = "auto"

  def __str__(self) -> str:
    return self.value

  @property
  def description(self) -> str:
    """What the policy keeps and recomputes."""
    return REMAT_POLICIES[self.value]

  @property
  def named(self) -> bool:
    """The policy acts on activations tagged with ``checkpoint_name`` (it
    needs ``ZeroConfig.remat_names``)."""
    return self.value in NAMED_POLICIES


# Every policy by name, with what it does (for the docs, the command line's
# choices and error messages).
REMAT_POLICIES: dict[str, str] = {
    "none": "no remat: keep every intermediate, including stage 3's gathered "
            "parameters (fastest, most memory)",
    "full": "save nothing inside a layer; recompute it (and re-gather its "
            "parameters) in backward",
    "dots_saveable": "keep matmul outputs without batch dims, recompute the "
                     "rest",
    "attention_saveable": "keep fused attention's outputs and softmax "
                          "statistics (cuDNN's flash attention, so backward "
                          "does not run its forward again), recompute the "
                          "rest",
    "dots_attention_saveable": "dots_saveable and attention_saveable "
                               "together",
    "save_only_named": "keep only activations tagged with "
                       "checkpoint_name(x, name) for a name in remat_names",
    "offload_to_host": "move activations tagged with a name in remat_names "
                       "to host memory (pinned_host) in forward and back in "
                       "backward; recompute the rest",
    "auto": "the fastest of AUTO_CANDIDATES whose compiled step fits the "
            "device's memory, chosen when the step is first compiled "
            "(ZeroConfig(remat='auto')); full outside an engine",
}

# What remat="auto" tries, fastest (most kept) first. Matmuls are most of
# what a transformer recomputes, attention's forward the costliest rest; its
# outputs are small (B x T x d plus B x H x T statistics per layer).
# (dots_saveable is left out: it keeps almost as much as
# dots_attention_saveable and recomputes more.)
AUTO_CANDIDATES = ("none", "dots_attention_saveable", "attention_saveable",
                   "full")

# Policies that act on activations tagged with ``checkpoint_name``.
NAMED_POLICIES = ("save_only_named", "offload_to_host")


def check_remat(name: object, names: tuple[str, ...] = ()) -> RematPolicy:
  """``name`` as a ``RematPolicy``.

  Raises:
    ValueError: unknown name, or a named policy without names.
  """
  if not isinstance(name, str) or name not in REMAT_POLICIES:
    raise ValueError(f"unknown remat policy {name!r}; choose one of "
                     f"{sorted(REMAT_POLICIES)}")
  policy = RematPolicy(name)
  if policy.named and not names:
    raise ValueError(
        f"remat={policy.value!r} needs remat_names: the checkpoint_name tags "
        "of the activations to keep, e.g. ZeroConfig(remat=..., "
        "remat_names=('mlp_hidden',)) with zero_jax.checkpoint_name(x, "
        "'mlp_hidden') in the layer")
  return policy


@dataclasses.dataclass(frozen=True)
class Activations(Section):
  """What backward keeps of forward, and where.

  Attributes:
    remat: rematerialization policy of each layer run by
      ``zero_jax.scan_layers`` (see ``REMAT_POLICIES``): ``"full"`` (save
      nothing, recompute the layer and re-gather its parameters in backward;
      the default), ``"none"`` (keep everything, including stage 3's gathered
      parameters), ``"dots_saveable"`` (keep matmul outputs, not gathered
      parameters), ``"attention_saveable"`` (keep cuDNN flash attention's
      outputs and statistics), ``"dots_attention_saveable"`` (both),
      ``"save_only_named"`` (keep the activations tagged with
      ``zero_jax.checkpoint_name`` for a name in ``names``),
      ``"offload_to_host"`` (move those to host memory until backward) or
      ``"auto"`` (the fastest that fits the device, chosen when the step
      is first compiled). Held as a ``RematPolicy``, which equals its name.
    names: the ``checkpoint_name`` tags the named policies act on.
      ``zero_jax.scan_layers`` tags each layer's input ``"layer_input"``:
      ``remat="offload_to_host"`` with ``names=("layer_input",)`` keeps the
      layer inputs (what ``"full"`` saves) in host memory, like DeepSpeed's
      ``cpu_checkpointing``.
    partition: ZeRO-R's Pa. With a ``model`` axis (tensor parallelism),
      each layer input that ``zero_jax.scan_layers`` saves for backward is
      stored split over ``model`` along the sequence (dimension 1 of a
      ``(batch, sequence, ...)`` carry) and gathered when backward needs
      it: 1/M of the bytes per device. With ``remat="offload_to_host"``
      and ``"layer_input"`` among ``names`` (Pa+cpu) the split inputs go to
      host memory. Without a ``model`` axis the layer inputs are already
      split over ``data`` with the batch, and there is nothing more to
      split (as in DeepSpeed with one model-parallel rank);
      ``Engine.describe()`` says so.
    device_memory_bytes: the memory per device ``remat="auto"`` fits the
      compiled step into (None: what the device reports).
  """

  NAME = "activations"
  SHORTHAND = {"remat": "remat", "names": "remat_names",
               "partition": "partition_activations",
               "device_memory_bytes": "device_memory_bytes"}

  remat: RematPolicy = RematPolicy.FULL
  names: tuple[str, ...] = ()
  partition: bool = False
  device_memory_bytes: int | None = None

  def __post_init__(self):
    if not isinstance(self.remat, str) or self.remat not in REMAT_POLICIES:
      self._fail("remat", f"one of {sorted(REMAT_POLICIES)}",
                "'full' (the default) recomputes each layer in backward.")
    if isinstance(self.names, (str, bytes)):
      raise ValueError(f"{self._label('names')} must be a tuple of names, "
                       f"got the string {self.names!r}; write "
                       f"({self.names!r},)")
    try:
      names = tuple(self.names)
    except TypeError:
      self._fail("names", "a tuple of checkpoint_name tags",
                "write e.g. ('mlp_hidden',), or () for none.")
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
      self._fail("names", "a tuple of non-empty strings",
                f"{bad[0]!r} is not a checkpoint_name tag; write the names "
                "given to zero_jax.checkpoint_name.")
    self._set("names", names)
    # (As the enum: equal to its name, so remat="full" reads the same.)
    self._set("remat", check_remat(self.remat, names))
    self._check("partition", check_bool,
               "True splits each saved layer input over the 'model' axis "
               "along the sequence (ZeRO-R's Pa).")
    self._check("device_memory_bytes", check_int, 1, optional=True,
               fix="give bytes per device, e.g. 80 * 2**30, or None for "
               "what the device reports.")
