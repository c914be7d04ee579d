"""optax transformations with the arithmetic of DeepSpeed's fused
optimizers and of the torch optimizers DeepSpeed falls back to.

Each returns the update *before* the learning rate
(``optimizer_from_deepspeed`` applies the rate last, so a schedule sets it)
and keeps its own count of updates applied, as DeepSpeed's ``state["step"]``.
Sources: ``csrc/adam/multi_tensor_adam.cu``,
``csrc/lamb/fused_lamb_cuda_kernel.cu``, ``csrc/lion/multi_tensor_lion.cu``
(DeepSpeed at commit edaa722); ``torch/optim/adam.py``, ``sgd.py``,
``adagrad.py`` (torch 2.x).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple
import weakref

import jax
import jax.numpy as jnp
import optax


# Hyperparameters of the transformations below: a number, or a function of
# the number of updates applied so far (OneCycle's cycled beta1).
Hyper = float | Callable[[jax.Array], jax.Array]


def real_dtype() -> Any:
  """The widest float JAX has on: float64 with x64, else float32."""
  return jax.dtypes.canonicalize_dtype(jnp.float64)


def as_real(x: Any) -> jax.Array:
  """``x`` (a count) in ``real_dtype()``: the rates are DeepSpeed's Python
  floats."""
  return jnp.asarray(x).astype(real_dtype())


def _at(value: Hyper, count: jax.Array) -> jax.Array:
  """A hyperparameter's value for this update, as an array: DeepSpeed's
  kernels take ``const float beta1`` and compute ``1 - beta1`` and
  ``1 - pow(beta1, step)`` from that same float, so both are consistent in
  float32 (a Python ``1 - 0.999`` is not ``1 - float32(0.999)``)."""
  value = value(count) if callable(value) else value
  return jnp.asarray(value, real_dtype())


def _one_minus_pow(beta: jax.Array, step: jax.Array) -> jax.Array:
  """``1 - beta ** step`` to float32's relative precision (DeepSpeed takes
  it in double): ``1 - 0.999 ** 2`` in float32 loses 5 digits."""
  return -jnp.expm1(step * jnp.log(beta))


def _need_params(params: Any, what: str) -> None:
  if params is None:
    raise ValueError(
        f"{what}'s update needs the parameters: call tx.update(grads, "
        "state, params)")


@dataclasses.dataclass(frozen=True)
class FusedForm:
  """What the fused host optimizer (``zero_jax.offload``) runs of a
  DeepSpeed optimizer built here.

  Attributes:
    kind: ``"adam"`` (FusedAdam, no AMSGrad), ``"lion"`` (FusedLion),
      ``"torch_sgd"`` or ``"torch_adagrad"`` (torch.optim's).
    weight_decay: the decay.
    decoupled: added to the update (AdamW, Lion); else to the gradient
      (Adam's L2).
    coefficients: of the number of updates applied before this one, this
      update's numbers, computed as the transformation computes them:
      ``b1``, ``b2`` and (Adam) ``eps``, ``bc1``, ``bc2``; SGD's
      ``momentum``, ``one_minus_damp``, ``first`` (1 at the first update:
      the buffer starts as the gradient) and ``nesterov`` (1 or 0);
      Adagrad's ``eps`` and ``decay`` (the step's lr_decay divisor).
  """

  kind: str
  weight_decay: float
  decoupled: bool
  coefficients: Callable[[jax.Array], dict[str, jax.Array]]


# tx.update -> its FusedForm (weak: as long as the transformation lives).
_FORMS: "weakref.WeakKeyDictionary[Callable, FusedForm]" = (
    weakref.WeakKeyDictionary())


def fused_form(tx: optax.GradientTransformation) -> FusedForm | None:
  """The ``FusedForm`` of a DeepSpeed optimizer built here (its direction,
  or ``optimizer_from_deepspeed``'s chain), else None."""
  try:
    return _FORMS.get(tx.update)
  except TypeError:  # (an update that takes no weak reference)
    return None


def same_form(tx: optax.GradientTransformation,
              of: optax.GradientTransformation
              ) -> optax.GradientTransformation:
  """``tx`` with the ``FusedForm`` of ``of`` (if it has one)."""
  form = fused_form(of)
  if form is not None:
    _FORMS[tx.update] = form
  return tx


class DeepSpeedAdamState(NamedTuple):
  """State of ``scale_by_adam``: updates so far and the two moments."""
  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  nu_max: optax.Updates  # AMSGrad's running max of nu; None without it


def scale_by_adam(b1: Hyper, b2: Hyper, eps: float, weight_decay: float,
                  adam_w_mode: bool, bias_correction: bool, amsgrad: bool
                  ) -> optax.GradientTransformation:
  """FusedAdam's update (``AdamFunctor``), or torch.optim.Adam(W)'s (the
  same arithmetic, plus AMSGrad). ``adam_w_mode``: decoupled weight decay
  added to the update; otherwise L2, added to the gradient."""

  def init(params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)
    return DeepSpeedAdamState(jnp.zeros([], jnp.int32), zeros(), zeros(),
                              zeros() if amsgrad else None)

  def update(grads, state, params=None):
    if weight_decay:
      _need_params(params, "Adam with weight_decay")
    beta1, beta2 = _at(b1, state.count), _at(b2, state.count)
    if weight_decay and not adam_w_mode:
      grads = jax.tree.map(lambda g, p: g + weight_decay * p, grads, params)
    mu = jax.tree.map(lambda m, g: (beta1 * m + (1 - beta1) * g
                                    ).astype(m.dtype), state.mu, grads)
    nu = jax.tree.map(lambda v, g: (beta2 * v + (1 - beta2) * g * g
                                    ).astype(v.dtype), state.nu, grads)
    nu_max = (jax.tree.map(jnp.maximum, state.nu_max, nu) if amsgrad
              else None)
    step = as_real(state.count + 1)
    bc1, bc2 = ((_one_minus_pow(beta1, step), _one_minus_pow(beta2, step))
                if bias_correction else (1.0, 1.0))

    def direction(g, m, v):
      return (m / bc1) / (jnp.sqrt(v / bc2) + eps)

    out = jax.tree.map(direction, grads, mu, nu_max if amsgrad else nu)
    if weight_decay and adam_w_mode:
      out = jax.tree.map(lambda u, p: u + weight_decay * p, out, params)
    out = jax.tree.map(lambda u, g: u.astype(g.dtype), out, grads)
    return out, DeepSpeedAdamState(optax.safe_increment(state.count), mu,
                                   nu, nu_max)

  def coefficients(count):
    beta1, beta2 = _at(b1, count), _at(b2, count)
    step = as_real(count + 1)
    one = jnp.ones((), real_dtype())
    bc1, bc2 = ((_one_minus_pow(beta1, step), _one_minus_pow(beta2, step))
                if bias_correction else (one, one))
    return dict(b1=beta1, b2=beta2, eps=jnp.asarray(eps, real_dtype()),
                bc1=bc1, bc2=bc2)

  tx = optax.GradientTransformation(init, update)
  if not amsgrad:
    _FORMS[tx.update] = FusedForm("adam", weight_decay, adam_w_mode,
                                  coefficients)
  return tx


def scale_by_lamb(b1: Hyper, b2: Hyper, eps: float, eps_inside_sqrt: bool,
                  weight_decay: float, bias_correction: bool,
                  max_coeff: float, min_coeff: float
                  ) -> optax.GradientTransformation:
  """FusedLamb's update (``lamb_cuda_kernel_part1``..``part3``), per
  parameter: ``u = m / (sqrt(v) + eps) + wd * p`` from the moments before
  bias correction; the trust ratio ``|p| / |u|`` clamped to
  ``[min_coeff, max_coeff]`` (1 where either norm is 0); the step
  ``lr * sqrt(1 - b2^t) / (1 - b1^t) * ratio * u``."""

  def init(params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)
    return DeepSpeedAdamState(jnp.zeros([], jnp.int32), zeros(), zeros(),
                              None)

  def update(grads, state, params=None):
    _need_params(params, "Lamb")
    beta1, beta2 = _at(b1, state.count), _at(b2, state.count)
    mu = jax.tree.map(lambda m, g: (beta1 * m + (1 - beta1) * g
                                    ).astype(m.dtype), state.mu, grads)
    nu = jax.tree.map(lambda v, g: (beta2 * v + (1 - beta2) * g * g
                                    ).astype(v.dtype), state.nu, grads)
    step = as_real(state.count + 1)
    scale = (jnp.sqrt(_one_minus_pow(beta2, step))
             / _one_minus_pow(beta1, step) if bias_correction else 1.0)

    def leaf(g, p, m, v):
      denom = jnp.sqrt(v + eps) if eps_inside_sqrt else jnp.sqrt(v) + eps
      u = m / denom + weight_decay * p
      w_norm = jnp.sqrt(jnp.sum(p * p))
      u_norm = jnp.sqrt(jnp.sum(u * u))
      ratio = w_norm / jnp.where(u_norm == 0, 1, u_norm)
      # The kernel's order: clamp to max first, then to min.
      ratio = jnp.where(ratio > max_coeff, max_coeff, ratio)
      ratio = jnp.where(ratio < min_coeff, min_coeff, ratio)
      ratio = jnp.where((w_norm != 0) & (u_norm != 0), ratio, 1.0)
      return (scale * ratio * u).astype(g.dtype)

    out = jax.tree.map(leaf, grads, params, mu, nu)
    return out, DeepSpeedAdamState(optax.safe_increment(state.count), mu,
                                   nu, None)

  return optax.GradientTransformation(init, update)


class DeepSpeedLionState(NamedTuple):
  """State of ``scale_by_lion``: updates so far and the momentum."""
  count: jax.Array
  mu: optax.Updates


def scale_by_lion(b1: Hyper, b2: Hyper, weight_decay: float
                  ) -> optax.GradientTransformation:
  """FusedLion's update (``LionFunctor``): ``c = b1 m + (1 - b1) g``; the
  step is ``lr * (+1 if c > 0 else -1) + lr * wd * p`` (the kernel moves a
  parameter whose ``c`` is exactly 0 by ``+lr``, unlike ``sign``)."""

  def init(params):
    return DeepSpeedLionState(jnp.zeros([], jnp.int32),
                              jax.tree.map(jnp.zeros_like, params))

  def update(grads, state, params=None):
    if weight_decay:
      _need_params(params, "Lion with weight_decay")
    beta1, beta2 = _at(b1, state.count), _at(b2, state.count)

    def direction(g, m):
      c = beta1 * m + (1 - beta1) * g
      return jnp.where(c > 0, 1.0, -1.0).astype(g.dtype)

    out = jax.tree.map(direction, grads, state.mu)
    if weight_decay:
      out = jax.tree.map(lambda u, p: (u + weight_decay * p).astype(u.dtype),
                         out, params)
    mu = jax.tree.map(lambda m, g: (beta2 * m + (1 - beta2) * g
                                    ).astype(m.dtype), state.mu, grads)
    return out, DeepSpeedLionState(optax.safe_increment(state.count), mu)

  tx = optax.GradientTransformation(init, update)
  _FORMS[tx.update] = FusedForm(
      "lion", weight_decay, True,
      lambda count: dict(b1=_at(b1, count), b2=_at(b2, count)))
  return tx


class TorchSGDState(NamedTuple):
  """State of ``scale_by_torch_sgd``: updates so far and the momentum
  buffer (None without momentum)."""
  count: jax.Array
  buf: optax.Updates


def scale_by_torch_sgd(momentum: float, dampening: float,
                       weight_decay: float, nesterov: bool
                       ) -> optax.GradientTransformation:
  """torch.optim.SGD: ``d = g + wd p``; the buffer starts as the first
  ``d`` (no dampening), then ``b = mu b + (1 - dampening) d``; the update
  is ``d + mu b`` (Nesterov) or ``b``."""

  def init(params):
    buf = jax.tree.map(jnp.zeros_like, params) if momentum else None
    return TorchSGDState(jnp.zeros([], jnp.int32), buf)

  def update(grads, state, params=None):
    if weight_decay:
      _need_params(params, "SGD with weight_decay")
      grads = jax.tree.map(lambda g, p: g + weight_decay * p, grads, params)
    if not momentum:
      return grads, TorchSGDState(optax.safe_increment(state.count), None)
    first = state.count == 0
    buf = jax.tree.map(
        lambda b, d: jnp.where(first, d, momentum * b + (1 - dampening) * d
                               ).astype(b.dtype), state.buf, grads)
    if nesterov:
      out = jax.tree.map(lambda d, b: (d + momentum * b).astype(d.dtype),
                         grads, buf)
    else:
      out = jax.tree.map(lambda d, b: b.astype(d.dtype), grads, buf)
    return out, TorchSGDState(optax.safe_increment(state.count), buf)

  tx = optax.GradientTransformation(init, update)
  _FORMS[tx.update] = FusedForm(
      "torch_sgd", weight_decay, False,
      lambda count: dict(momentum=jnp.float32(momentum),
                         one_minus_damp=jnp.float32(1 - dampening),
                         first=(count == 0).astype(jnp.float32),
                         nesterov=jnp.float32(nesterov)))
  return tx


class TorchAdagradState(NamedTuple):
  """State of ``scale_by_torch_adagrad``: updates so far and the sum of
  squared gradients."""
  count: jax.Array
  sum: optax.Updates


def scale_by_torch_adagrad(lr_decay: float, weight_decay: float,
                           initial_accumulator_value: float, eps: float
                           ) -> optax.GradientTransformation:
  """torch.optim.Adagrad: ``d = g + wd p``; ``s += d^2``; the update is
  ``d / (sqrt(s) + eps) / (1 + (t - 1) lr_decay)`` at step t = 1, 2, ..."""

  def init(params):
    return TorchAdagradState(
        jnp.zeros([], jnp.int32),
        jax.tree.map(lambda p: jnp.full_like(p, initial_accumulator_value),
                     params))

  def update(grads, state, params=None):
    if weight_decay:
      _need_params(params, "Adagrad with weight_decay")
      grads = jax.tree.map(lambda g, p: g + weight_decay * p, grads, params)
    total = jax.tree.map(lambda s, d: (s + d * d).astype(s.dtype),
                         state.sum, grads)
    decay = 1 + as_real(state.count) * lr_decay
    out = jax.tree.map(
        lambda d, s: (d / (jnp.sqrt(s) + eps) / decay).astype(d.dtype),
        grads, total)
    return out, TorchAdagradState(optax.safe_increment(state.count), total)

  tx = optax.GradientTransformation(init, update)
  _FORMS[tx.update] = FusedForm(
      "torch_adagrad", weight_decay, False,
      lambda count: dict(eps=jnp.float32(eps),
                         decay=1 + as_real(count) * lr_decay))
  return tx
