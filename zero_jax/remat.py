"""Rematerialization policies by name: the table ``ZeroConfig.remat``
checks against and the ``jax.checkpoint`` policy each name stands for."""

from __future__ import annotations

from typing import Any

import jax

# Remat policies by name. None of them saves gathered parameters: saving them
# would keep every layer's full parameters alive until backward (stage 2
# memory at stage 3).
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
            "(zero_jax.auto_remat); full outside an engine",
}

# What remat="auto" tries, fastest (most kept) first. Matmuls are most of
# what a transformer recomputes, attention's forward the costliest rest; its
# outputs are small (B x T x d plus B x H x T statistics per layer).
# (dots_saveable is left out: it keeps almost as much as
# dots_attention_saveable and recomputes more.)
AUTO_CANDIDATES = ("none", "dots_attention_saveable", "attention_saveable",
                   "full")

# The primitive of jax.nn.dot_product_attention's cuDNN forward (jax 0.10 to
# 0.12), whose outputs are the attention's output and softmax statistics:
# what its backward kernel needs besides q, k, v.
_FUSED_ATTENTION_FORWARD = "dot_product_attention_fwd_wrapper"


def _attention_saveable(prim: Any, *_, **__) -> bool:
  return prim.name == _FUSED_ATTENTION_FORWARD

# Policies that act on activations tagged with ``checkpoint_name``.
NAMED_POLICIES = ("save_only_named", "offload_to_host")


def remat_policy(name: str, names: tuple[str, ...] = ()) -> Any:
  """The ``jax.checkpoint`` policy for a ``REMAT_POLICIES`` name.

  Args:
    name: a key of ``REMAT_POLICIES``.
    names: for ``"save_only_named"`` and ``"offload_to_host"``: the
      ``checkpoint_name`` tags the policy saves or offloads.

  Returns:
    A policy for ``jax.checkpoint`` (None for ``"none"``: no checkpoint).

  Raises:
    ValueError: unknown name, or a named policy without names.
  """
  if name not in REMAT_POLICIES:
    raise ValueError(f"unknown remat policy {name!r}; choose one of "
                     f"{sorted(REMAT_POLICIES)}")
  if name in NAMED_POLICIES and not names:
    raise ValueError(
        f"remat={name!r} needs remat_names: the checkpoint_name tags of the "
        "activations to keep, e.g. ZeroConfig(remat=..., remat_names=("
        "'mlp_hidden',)) with zero_jax.checkpoint_name(x, 'mlp_hidden') in the "
        "layer")
  cp = jax.checkpoint_policies
  if name == "auto":  # (not chosen yet: outside an engine)
    name = "full"
  if name == "none":
    return None
  if name == "full":
    return cp.nothing_saveable
  if name == "dots_saveable":
    return cp.dots_with_no_batch_dims_saveable
  if name == "attention_saveable":
    return _attention_saveable
  if name == "dots_attention_saveable":
    return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                      _attention_saveable)
  if name == "save_only_named":
    return cp.save_only_these_names(*names)
  return cp.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
      offload_src="device", offload_dst="pinned_host")
