"""Rematerialization policies by name: ``RematPolicy``, what
``ZeroConfig.remat`` holds. (The ``jax.checkpoint`` policy each stands for
is ``zero_jax.layers.remat_policy``.)"""

from __future__ import annotations

import enum


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
