"""Optimizers the host updates in one fused pass (``update_on="host"``).

Each is optax's own optimizer under ``optax.inject_hyperparams`` (so its
hyperparameters, schedules included, are in its state, and the engine
reports the learning rate of each update), remembered with the rule its
fused kernel follows. Any other optax transformation still trains with
``update_on="host"``: it runs as an XLA:CPU program instead, and
``Engine.describe()`` says which runs.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable
import weakref

import jax
import numpy as np
import optax

from zero_jax.config._ds_transforms import FusedForm, fused_form


class Kind(enum.Enum):
  """The fused kernel an optimizer's update runs."""

  ADAM = "adam"
  LION = "lion"
  SGD = "sgd"
  ADAGRAD = "adagrad"
  # torch.optim's, which zj.initialize builds for DeepSpeed's SGD and
  # Adagrad.
  TORCH_SGD = "torch_sgd"
  TORCH_ADAGRAD = "torch_adagrad"


@dataclasses.dataclass(frozen=True)
class HostRule:
  """How the fused host optimizer runs a transformation.

  Attributes:
    kind: the kernel.
    mask: optax's weight-decay ``mask`` (a tree of bools, or a function of
      the parameters that returns one; None: every leaf decays).
    nesterov: SGD's Nesterov momentum.
    deepspeed: a DeepSpeed optimizer's form (``zj.initialize``'s FusedAdam,
      FusedLion, SGD or Adagrad: ``zero_jax.config._ds_transforms``); None:
      optax's.
  """

  kind: Kind
  mask: Any = None
  nesterov: bool = False
  deepspeed: FusedForm | None = None


# tx.update -> its rule. Weak: a rule lives as long as its transformation.
_RULES: "weakref.WeakKeyDictionary[Callable, HostRule]" = (
    weakref.WeakKeyDictionary())


def rule_of(tx: optax.GradientTransformation) -> HostRule | None:
  """The fused rule of ``tx``: built here, or DeepSpeed's FusedAdam (no
  AMSGrad), FusedLion, SGD or Adagrad built by ``zj.initialize``; else
  None."""
  try:
    rule = _RULES.get(tx.update)
  except TypeError:  # (an update that takes no weak reference)
    return None
  form = fused_form(tx)
  if rule is None and form is not None:
    rule = HostRule(Kind(form.kind), deepspeed=form)
  return rule


def decays(rule: HostRule, master: Any) -> list[bool]:
  """Per master leaf, whether weight decay applies (optax's ``mask``)."""
  n = len(jax.tree.leaves(master))
  if rule.mask is None:
    return [True] * n
  tree = rule.mask(master) if callable(rule.mask) else rule.mask
  leaves = jax.tree.leaves(tree)
  if len(leaves) != n or not all(isinstance(b, (bool, np.bool_))
                                 for b in leaves):
    raise ValueError(
        "the weight-decay mask of a fused host optimizer must be a tree of "
        "Python bools with one per parameter leaf (or a function of the "
        f"parameters returning one); got {len(leaves)} leaves for {n} "
        "parameters. Pass such a mask, or build the optimizer with optax "
        "itself (it then runs as an XLA:CPU program)")
  return [bool(b) for b in leaves]


def _fused(tx: optax.GradientTransformation,
           rule: HostRule) -> optax.GradientTransformation:
  _RULES[tx.update] = rule
  return tx


def adamw(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9,
          b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
          weight_decay: float = 1e-4, mask: Any = None
          ) -> optax.GradientTransformation:
  """``optax.adamw`` (same arguments and defaults), fused on the host.

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, eps_root: Adam's; each may be a schedule too.
    weight_decay: decoupled weight decay.
    mask: optax's: which leaves decay (a tree of bools or a function of
      the parameters returning one).

  Returns:
    ``optax.inject_hyperparams(optax.adamw)`` of these arguments.
  """
  tx = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
      learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
      weight_decay=weight_decay, mask=mask)
  return _fused(tx, HostRule(Kind.ADAM, mask))


def adam(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9,
         b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0
         ) -> optax.GradientTransformation:
  """``optax.adam`` (same arguments and defaults), fused on the host."""
  tx = optax.inject_hyperparams(optax.adam)(
      learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root)
  return _fused(tx, HostRule(Kind.ADAM))


def lion(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9,
         b2: float = 0.99, weight_decay: float = 1e-3, mask: Any = None
         ) -> optax.GradientTransformation:
  """``optax.lion`` (same arguments and defaults), fused on the host."""
  tx = optax.inject_hyperparams(optax.lion, static_args=("mask",))(
      learning_rate=learning_rate, b1=b1, b2=b2, weight_decay=weight_decay,
      mask=mask)
  return _fused(tx, HostRule(Kind.LION, mask))


def sgd(learning_rate: optax.ScalarOrSchedule, momentum: float | None = None,
        nesterov: bool = False) -> optax.GradientTransformation:
  """``optax.sgd`` (same arguments and defaults), fused on the host."""
  tx = optax.inject_hyperparams(optax.sgd)(
      learning_rate=learning_rate, momentum=momentum, nesterov=nesterov)
  return _fused(tx, HostRule(Kind.SGD, nesterov=nesterov))


def adagrad(learning_rate: optax.ScalarOrSchedule,
            initial_accumulator_value: float = 0.1, eps: float = 1e-7
            ) -> optax.GradientTransformation:
  """``optax.adagrad`` (same arguments and defaults), fused on the host."""
  tx = optax.inject_hyperparams(optax.adagrad)(
      learning_rate=learning_rate,
      initial_accumulator_value=initial_accumulator_value, eps=eps)
  return _fused(tx, HostRule(Kind.ADAGRAD))


def find_state(tree: Any, kind: type) -> Any:
  """The one state of type ``kind`` inside ``tree``."""
  found = [s for s in jax.tree.leaves(tree, is_leaf=lambda s: isinstance(
      s, kind)) if isinstance(s, kind)]
  assert len(found) == 1, (kind, len(found))
  return found[0]


def per_leaf_state(arrays: list, n: int) -> list[list[Any]]:
  """Per master leaf, its parameter-shaped optimizer-state leaves in tree
  order (the moments are parameter-shaped trees one after the other: mu's
  n leaves, then nu's)."""
  assert len(arrays) % n == 0, (len(arrays), n)
  per = len(arrays) // n
  return [[arrays[t * n + j] for t in range(per)] for j in range(n)]
