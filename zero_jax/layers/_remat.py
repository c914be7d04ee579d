"""The ``jax.checkpoint`` policy each ``RematPolicy`` stands for."""

from __future__ import annotations

from typing import Any, Iterable

import jax

from zero_jax import materialize
from zero_jax.config import RematPolicy
from zero_jax.config._remat import check_remat
from zero_jax.materialize._materializer import KEPT

# The primitive of jax.nn.dot_product_attention's cuDNN forward (jax 0.10 to
# 0.12), whose outputs are the attention's output and softmax statistics:
# what its backward kernel needs besides q, k, v.
_FUSED_ATTENTION_FORWARD = "dot_product_attention_fwd_wrapper"


def _attention_saveable(prim: Any, *_, **__) -> bool:
  return prim.name == _FUSED_ATTENTION_FORWARD


def remat_policy(name: str | RematPolicy, names: tuple[str, ...] = (),
                 keep: tuple[str, ...] = ()) -> Any:
  """The ``jax.checkpoint`` policy for a remat policy name.

  Args:
    name: a ``RematPolicy`` (or its name).
    names: for ``"save_only_named"`` and ``"offload_to_host"``: the
      ``checkpoint_name`` tags the policy saves or offloads.
    keep: ``checkpoint_name`` tags saved on the device whatever the policy
      (hpZ's secondary copy, ``zero_jax.materialize.SECONDARY``).

  Returns:
    A policy for ``jax.checkpoint`` (None for ``"none"``: no checkpoint).

  Raises:
    ValueError: unknown name, or a named policy without names.
  """
  policy = _policy(check_remat(name, tuple(names)), tuple(names))
  if policy is None or not keep:
    return policy

  def keeping(prim, *args, **params):
    # (``checkpoint_name``'s primitive is called "name", as
    # ``jax.checkpoint_policies.save_only_these_names`` reads it; the
    # policies' own combiner refuses the offloading policy's answers.)
    if prim.name == "name" and params.get("name") in keep:
      return True
    return policy(prim, *args, **params)

  return keeping


def kept_names(hows: Iterable[tuple[Any, Any]]) -> tuple[str, ...]:
  """The ``checkpoint_name`` tags remat must keep (``remat_policy``'s
  ``keep``) for a block made whole by these ``(Materializer, LeafPlan)``
  pairs: hpZ's secondary copy where any plan is hierarchical, so that
  backward gathers from it; the gathered parameters themselves where a
  materializer keeps them (stage 2 gathering in forward), so that backward does
  not gather at all."""
  hows = list(hows)
  names = ((materialize.SECONDARY,) if any(lp.hierarchical for _, lp in hows)
           else ())
  return names + ((KEPT,) if any(m.keep for m, _ in hows)
                  else ())


def _policy(policy: RematPolicy, names: tuple[str, ...]) -> Any:
  cp = jax.checkpoint_policies
  if policy is RematPolicy.AUTO:  # (not chosen yet: outside an engine)
    policy = RematPolicy.FULL
  if policy is RematPolicy.NONE:
    return None
  if policy is RematPolicy.FULL:
    return cp.nothing_saveable
  if policy is RematPolicy.DOTS_SAVEABLE:
    return cp.dots_with_no_batch_dims_saveable
  if policy is RematPolicy.ATTENTION_SAVEABLE:
    return _attention_saveable
  if policy is RematPolicy.DOTS_ATTENTION_SAVEABLE:
    return cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                      _attention_saveable)
  if policy is RematPolicy.SAVE_ONLY_NAMED:
    return cp.save_only_these_names(*names)
  return cp.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
      offload_src="device", offload_dst="pinned_host")
