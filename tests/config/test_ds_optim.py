"""The optax transformation of DeepSpeed's optimizer and scheduler sections
matches DeepSpeed's formulas, step for step.

Each reference below is a float64 numpy port of DeepSpeed's (or torch's)
code, written from the source: DeepSpeed at commit edaa722 (after v0.19.5),
torch 2.x. The schedulers are ported as objects with DeepSpeed's
``last_batch_iteration`` / ``step()`` protocol and driven as
``DeepSpeedEngine._take_model_step`` drives them (constructor, then one
``step()`` after each optimizer step), so the test checks the step counting
too, not only the formulas.
"""

import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zero_jax.config._ds_optim import (OPTIMIZERS, SCHEDULERS,
                                       optimizer_from_deepspeed,
                                       schedule_from_deepspeed)
from zero_jax.config._ds_schedules import parse_schedule

# ---------------------------------------------------------------------------
# Reference schedulers: deepspeed/runtime/lr_schedules.py, one param group.
# ``group`` plays torch's param_group: the optimizer reads lr and betas.


class RefWarmupLR:
  """lr_schedules.WarmupLR (__init__, get_lr, step, _get_gamma)."""

  def __init__(self, group, warmup_min_lr=0.0, warmup_max_lr=None,
               warmup_num_steps=1000, warmup_type="log"):
    if warmup_max_lr is None:
      warmup_max_lr = group["lr"]
    self.group = group
    self.min_lr = warmup_min_lr
    self.delta_lr = warmup_max_lr - warmup_min_lr
    self.warmup_num_steps = max(2, warmup_num_steps)
    self.warmup_type = warmup_type
    self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
    self.last_batch_iteration = -1
    group["lr"] = self.get_lr()  # "Initialize lr in optimizer"

  def get_lr(self):
    if self.last_batch_iteration < 0:
      return self.min_lr
    return self.min_lr + self.delta_lr * self._get_gamma()

  def step(self):
    self.last_batch_iteration += 1
    self.group["lr"] = self.get_lr()

  def _warm(self):
    if self.warmup_type == "log":
      return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
    return self.last_batch_iteration / self.warmup_num_steps

  def _get_gamma(self):
    if self.last_batch_iteration < self.warmup_num_steps:
      return self._warm()
    return 1.0


class RefWarmupDecayLR(RefWarmupLR):
  """lr_schedules.WarmupDecayLR (its warmup_max_lr defaults to 0.001)."""

  def __init__(self, group, total_num_steps, warmup_min_lr=0.0,
               warmup_max_lr=0.001, warmup_num_steps=1000,
               warmup_type="log"):
    self.total_num_steps = total_num_steps
    super().__init__(group, warmup_min_lr, warmup_max_lr, warmup_num_steps,
                     warmup_type)

  def _get_gamma(self):
    if self.last_batch_iteration < self.warmup_num_steps:
      return self._warm()
    return max(0.0, float(self.total_num_steps - self.last_batch_iteration)
               / float(max(1.0, self.total_num_steps
                           - self.warmup_num_steps)))


class RefWarmupCosineLR:
  """lr_schedules.WarmupCosineLR (get_lr_ratio, get_lr, step)."""

  def __init__(self, group, total_num_steps, warmup_min_ratio=0.0,
               warmup_num_steps=1000, cos_min_ratio=0.0001,
               warmup_type="log"):
    self.group = group
    self.total_num_steps = total_num_steps
    self.last_batch_iteration = -1
    self.cos_min_ratio = cos_min_ratio
    self.warmup_type = warmup_type
    self.warmup_min_ratio = warmup_min_ratio
    self.warmup_num_steps = max(2, warmup_num_steps)
    self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
    self.org_lr = group["lr"]
    group["lr"] = self.get_lr()

  def get_lr_ratio(self):
    if self.last_batch_iteration < 0:
      return 0.0
    if self.last_batch_iteration < self.warmup_num_steps:
      if self.warmup_type == "log":
        ratio = self.inverse_log_warm_up * math.log(
            self.last_batch_iteration + 1)
      else:
        ratio = self.last_batch_iteration / self.warmup_num_steps
      return self.warmup_min_ratio + ratio * (1. - self.warmup_min_ratio)
    real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
    real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
    cosine_progress = min(1.0, real_last_step / real_total_steps)
    ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
    return max(0.0, self.cos_min_ratio + (1. - self.cos_min_ratio) * ratio)

  def get_lr(self):
    if self.last_batch_iteration < 0:
      return 0.0
    return self.org_lr * self.get_lr_ratio()

  def step(self):
    self.last_batch_iteration += 1
    self.group["lr"] = self.get_lr()


class RefLRRangeTest:
  """lr_schedules.LRRangeTest."""

  def __init__(self, group, lr_range_test_min_lr=1e-3,
               lr_range_test_step_size=2000, lr_range_test_step_rate=1.0,
               lr_range_test_staircase=False):
    self.group = group
    self.min_lr = lr_range_test_min_lr
    self.step_size = lr_range_test_step_size
    self.step_rate = lr_range_test_step_rate
    self.staircase = lr_range_test_staircase
    self.last_batch_iteration = -1
    group["lr"] = self.min_lr

  def get_lr(self):
    x = float(self.last_batch_iteration + 1) / self.step_size
    interval = math.floor(x) if self.staircase else x
    return self.min_lr * (1 + self.step_rate * interval)

  def step(self):
    self.last_batch_iteration += 1
    self.group["lr"] = self.get_lr()


class RefOneCycle:
  """lr_schedules.OneCycle (_initialize_cycle/_lr/_momentum,
  _get_scale_factor, _get_cycle_lr/_mom, _get_decay_lr/_mom, step).
  ``has_betas``: whether the optimizer's defaults hold betas."""

  def __init__(self, group, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.,
               cycle_first_step_size=2000, cycle_second_step_size=None,
               cycle_first_stair_count=0, cycle_second_stair_count=None,
               decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8,
               cycle_max_mom=0.9, decay_mom_rate=0., has_betas=True):
    self.group = group
    first = float(cycle_first_step_size)
    second = (float(cycle_second_step_size)
              if cycle_second_step_size is not None else first)
    self.total_size = first + second
    self.step_ratio = first / self.total_size
    self.first_step_size, self.second_step_size = first, second
    self.first_stair_count = cycle_first_stair_count
    self.second_stair_count = (cycle_first_stair_count
                               if cycle_second_stair_count is None
                               else cycle_second_stair_count)
    self.decay_step_size = decay_step_size
    self.skip_lr_decay = self.skip_mom_decay = math.isclose(
        decay_step_size, 0)
    self.min_lr, self.max_lr = cycle_min_lr, cycle_max_lr
    group["lr"] = cycle_min_lr
    self.decay_lr_rate = decay_lr_rate
    if math.isclose(decay_lr_rate, 0):
      self.skip_lr_decay = True
    self.cycle_momentum = cycle_momentum and has_betas
    if self.cycle_momentum:
      self.decay_mom_rate = decay_mom_rate
      self.min_mom = (cycle_min_mom, 0.99)
      self.max_mom = (cycle_max_mom, 0.99)
      group["betas"] = self.min_mom
      if math.isclose(decay_mom_rate, 0):
        self.skip_mom_decay = True
    self.last_batch_iteration = -1

  def _get_scale_factor(self):
    batch_iteration = self.last_batch_iteration + 1
    cycle = math.floor(1 + batch_iteration / self.total_size)
    x = 1. + batch_iteration / self.total_size - cycle
    if x <= self.step_ratio:
      scale_factor = x / self.step_ratio
      stair_count = self.first_stair_count
    else:
      scale_factor = (x - 1) / (self.step_ratio - 1)
      stair_count = self.second_stair_count
    if stair_count > 0:
      cycle_iteration = batch_iteration % self.total_size
      if cycle_iteration <= self.first_step_size:
        stair_position = (cycle_iteration * stair_count
                          / self.first_step_size)
      else:
        stair_position = ((self.total_size - cycle_iteration) * stair_count
                          / self.second_step_size)
      scale_factor = math.floor(stair_position) / stair_count
    return scale_factor

  def get_lr(self):
    if self.last_batch_iteration < self.total_size:
      return (self.min_lr
              + (self.max_lr - self.min_lr) * self._get_scale_factor())
    if self.skip_lr_decay:
      return self.min_lr
    interval = ((self.last_batch_iteration - self.total_size + 1)
                / self.decay_step_size)
    return self.min_lr / (1 + self.decay_lr_rate * interval)

  def get_mom(self):
    lo, hi = self.min_mom[0], self.max_mom[0]
    if self.last_batch_iteration < self.total_size:
      return (hi - (hi - lo) * self._get_scale_factor(), 0.99)
    if self.skip_mom_decay:
      return self.max_mom
    interval = ((self.last_batch_iteration - self.total_size + 1)
                / self.decay_step_size)
    return (hi * (1 + self.decay_mom_rate * interval), 0.99)

  def step(self):
    self.last_batch_iteration += 1
    self.group["lr"] = self.get_lr()
    if self.cycle_momentum:
      self.group["betas"] = self.get_mom()


_REF_SCHEDULERS = {"WarmupLR": RefWarmupLR, "WarmupDecayLR": RefWarmupDecayLR,
                   "WarmupCosineLR": RefWarmupCosineLR,
                   "LRRangeTest": RefLRRangeTest, "OneCycle": RefOneCycle}

# ---------------------------------------------------------------------------
# Reference optimizers: one step on a dict of float64 numpy arrays, reading
# lr and betas from ``group`` as the kernels read param_group.


class RefFusedAdam:
  """deepspeed/ops/adam/fused_adam.py FusedAdam.step and
  csrc/adam/multi_tensor_adam.cu AdamFunctor (ADAM_MODE_0: L2,
  ADAM_MODE_1: decoupled) with multi_tensor_adam_cuda's bias corrections."""

  def __init__(self, group, adam_w_mode=True):
    self.group, self.mode = group, adam_w_mode
    self.t, self.m, self.v = 0, {}, {}

  def step(self, params, grads):
    g_ = self.group
    beta1, beta2 = g_["betas"]
    self.t += 1
    bc1, bc2 = ((1 - beta1 ** self.t, 1 - beta2 ** self.t)
                if g_["bias_correction"] else (1.0, 1.0))
    decay, lr, eps = g_["weight_decay"], g_["lr"], g_["eps"]
    for k, p in params.items():
      g = grads[k]
      m, v = self.m.get(k, 0 * p), self.v.get(k, 0 * p)
      if not self.mode:
        g = g + decay * p
      m = beta1 * m + (1 - beta1) * g
      v = beta2 * v + (1 - beta2) * g * g
      update = (m / bc1) / (np.sqrt(v / bc2) + eps)
      if self.mode:
        update = update + decay * p
      params[k] = p - lr * update
      self.m[k], self.v[k] = m, v


class RefTorchAdam:
  """torch/optim/adam.py _single_tensor_adam (Adam: L2 into the grad;
  AdamW: param *= 1 - lr * wd first), with amsgrad."""

  def __init__(self, group, decoupled, amsgrad):
    self.group, self.decoupled, self.amsgrad = group, decoupled, amsgrad
    self.t, self.m, self.v, self.vmax = 0, {}, {}, {}

  def step(self, params, grads):
    g_ = self.group
    beta1, beta2 = g_["betas"]
    lr, wd, eps = g_["lr"], g_["weight_decay"], g_["eps"]
    self.t += 1
    for k, p in params.items():
      grad = grads[k]
      if wd != 0:
        if self.decoupled:
          p = p * (1 - lr * wd)
        else:
          grad = grad + wd * p
      m = self.m.get(k, 0 * p)
      m = m + (grad - m) * (1 - beta1)  # exp_avg.lerp_(grad, 1 - beta1)
      v = self.v.get(k, 0 * p) * beta2 + (1 - beta2) * grad * grad
      bc1 = 1 - beta1 ** self.t
      bc2_sqrt = math.sqrt(1 - beta2 ** self.t)
      if self.amsgrad:
        self.vmax[k] = np.maximum(self.vmax.get(k, 0 * p), v)
        denom = np.sqrt(self.vmax[k]) / bc2_sqrt + eps
      else:
        denom = np.sqrt(v) / bc2_sqrt + eps
      params[k] = p - (lr / bc1) * m / denom
      self.m[k], self.v[k] = m, v


class RefFusedLamb:
  """deepspeed/ops/lamb/fused_lamb.py FusedLamb.step and
  csrc/lamb/fused_lamb_cuda_kernel.cu (fused_lamb_cuda's step_size,
  lamb_cuda_kernel_part1's norms, part3's clamped lamb_coeff), per
  parameter tensor, grad_scale 1."""

  def __init__(self, group, eps_inside_sqrt=False):
    self.group, self.inside, self.t, self.m, self.v = (
        group, eps_inside_sqrt, 0, {}, {})
    self.coeffs = []

  def step(self, params, grads):
    g_ = self.group
    b1, b2 = g_["betas"]
    self.t += 1
    if g_["bias_correction"]:
      step_size = (g_["lr"] * math.sqrt(1 - b2 ** self.t)
                   / (1 - b1 ** self.t))
    else:
      step_size = g_["lr"]
    for k, p in params.items():
      g = grads[k]
      m = b1 * self.m.get(k, 0 * p) + (1 - b1) * g
      v = b2 * self.v.get(k, 0 * p) + (1 - b2) * g * g
      denom = np.sqrt(v + g_["eps"]) if self.inside else np.sqrt(v) + g_["eps"]
      update = m / denom + g_["weight_decay"] * p
      reg_w = math.sqrt(float(np.sum(p * p)))
      reg_u = math.sqrt(float(np.sum(update * update)))
      lamb_coeff = 1.0
      if reg_w != 0 and reg_u != 0:
        lamb_coeff = reg_w / reg_u
        if lamb_coeff > g_["max_coeff"]:
          lamb_coeff = g_["max_coeff"]
        if lamb_coeff < g_["min_coeff"]:
          lamb_coeff = g_["min_coeff"]
      self.coeffs.append(lamb_coeff)
      params[k] = p - step_size * lamb_coeff * update
      self.m[k], self.v[k] = m, v


class RefFusedLion:
  """deepspeed/ops/lion/fused_lion.py and csrc/lion/multi_tensor_lion.cu
  LionFunctor: c = b1 m + (1 - b1) g; p = p (1 - lr wd) + (c > 0 ? -lr :
  lr); m = b2 m + (1 - b2) g."""

  def __init__(self, group):
    self.group, self.m = group, {}

  def step(self, params, grads):
    b1, b2 = self.group["betas"]
    lr, wd = self.group["lr"], self.group["weight_decay"]
    for k, p in params.items():
      g, m = grads[k], self.m.get(k, 0 * params[k])
      c = b1 * m + (1 - b1) * g
      params[k] = p * (1.0 - lr * wd) + np.where(c > 0, -lr, lr)
      self.m[k] = b2 * m + (1 - b2) * g


class RefTorchSGD:
  """torch/optim/sgd.py _single_tensor_sgd."""

  def __init__(self, group):
    self.group, self.buf = group, {}

  def step(self, params, grads):
    g_ = self.group
    for k, p in params.items():
      grad = grads[k]
      if g_["weight_decay"] != 0:
        grad = grad + g_["weight_decay"] * p
      if g_["momentum"] != 0:
        buf = self.buf.get(k)
        if buf is None:
          buf = grad.copy()
        else:
          buf = buf * g_["momentum"] + (1 - g_["dampening"]) * grad
        self.buf[k] = buf
        grad = grad + g_["momentum"] * buf if g_["nesterov"] else buf
      params[k] = p - g_["lr"] * grad


class RefTorchAdagrad:
  """torch/optim/adagrad.py _single_tensor_adagrad."""

  def __init__(self, group):
    self.group, self.sum, self.t = group, {}, 0

  def step(self, params, grads):
    g_ = self.group
    self.t += 1
    clr = g_["lr"] / (1 + (self.t - 1) * g_["lr_decay"])
    for k, p in params.items():
      grad = grads[k]
      if g_["weight_decay"] != 0:
        grad = grad + g_["weight_decay"] * p
      s = self.sum.get(k, np.full_like(p, g_["initial_accumulator_value"]))
      s = s + grad * grad
      self.sum[k] = s
      params[k] = p - clr * grad / (np.sqrt(s) + g_["eps"])


# ---------------------------------------------------------------------------
# The driver.


def _params(rng, kind="plain"):
  """A small pytree with several leaves (nested, of different shapes)."""
  params = {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=(5,)) * 0.1,
            "block": {"scale": 1.0 + rng.normal(size=(2, 2, 2))}}
  if kind == "lamb":
    # Trust ratios above max_coeff, below min_coeff, and |p| = 0.
    params.update(big=100.0 + rng.normal(size=(3,)),
                  tiny=1e-5 * rng.normal(size=(3, 2)), zero=np.zeros((2,)))
  if kind == "zero_grad":
    params["frozen"] = rng.normal(size=(3,))
  return params


def _flat(tree):
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in
          jax.tree_util.tree_flatten_with_path(tree)[0]}


def _unflat(flat, like):
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(like)[0]]
  return jax.tree.unflatten(jax.tree.structure(like),
                            [jnp.asarray(flat[p]) for p in paths])


def _grads(rng, flat, k):
  """Gradients that depend on the step and the parameters; a leaf named
  ``frozen`` gets none."""
  return {name: (np.zeros_like(p) if "frozen" in name else
                 np.sin(p * (k + 1)) + 0.5 * rng.normal(size=p.shape))
          for name, p in flat.items()}


def _compare(optimizer, scheduler, ref_opt, group, sched=None, steps=8,
             kind="plain", rtol=1e-12, atol=1e-14):
  """Runs ``optimizer_from_deepspeed`` (float64) and the reference side by
  side: parameters and the injected learning rate after every step."""
  rng = np.random.default_rng(0)
  with jax.enable_x64(True):
    tx = optimizer_from_deepspeed(optimizer, scheduler)
    params = _params(rng, kind)
    ref = _flat(params)
    params = jax.tree.map(jnp.asarray, params)
    state = tx.init(params)
    update = jax.jit(tx.update)
    if sched is not None:
      sched = sched(group)
    for k in range(steps):
      grads = _grads(rng, ref, k)
      lr_used = group["lr"]
      ref_opt.step(ref, grads)
      if sched is not None:
        sched.step()  # DeepSpeedEngine._take_model_step, after step()
      updates, state = update(_unflat(grads, params), state, params)
      params = optax.apply_updates(params, updates)
      got = _flat(params)
      for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=rtol,
                                   atol=atol, err_msg=f"{name} step {k}")
      rate = state[1].hyperparams["learning_rate"]
      np.testing.assert_allclose(rate, lr_used, rtol=1e-13, atol=1e-300,
                                 err_msg=f"lr at step {k}")
  return ref_opt


_WD = 0.1


def _group(**kw):
  group = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
               bias_correction=True)
  group.update(kw)
  return group


def test_names():
  assert OPTIMIZERS == ("adam", "adamw", "lamb", "lion", "sgd", "adagrad")
  assert SCHEDULERS == ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                        "OneCycle", "LRRangeTest")


@pytest.mark.parametrize("kind", ["Adam", "adamw", "ADAMW"])
def test_fused_adam_decoupled(kind):
  # "Adam" is AdamW unless adam_w_mode is false (ADAM_W_MODE_DEFAULT).
  params = {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6,
            "weight_decay": _WD}
  group = _group(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=_WD)
  _compare({"type": kind, "params": params}, None,
           RefFusedAdam(group, adam_w_mode=True), group)


def test_fused_adam_l2_without_bias_correction():
  params = {"lr": 0.01, "weight_decay": _WD, "adam_w_mode": False,
            "bias_correction": False}
  group = _group(lr=0.01, weight_decay=_WD, bias_correction=False)
  _compare({"type": "Adam", "params": params}, None,
           RefFusedAdam(group, adam_w_mode=False), group)


def test_adamw_ignores_adam_w_mode_false():
  # engine: effective_adam_w_mode = name == "adamw" or adam_w_mode.
  params = {"lr": 0.01, "weight_decay": _WD, "adam_w_mode": False}
  group = _group(lr=0.01, weight_decay=_WD)
  _compare({"type": "AdamW", "params": params}, None,
           RefFusedAdam(group, adam_w_mode=True), group)


def test_fused_adam_defaults_and_float32():
  # FusedAdam's defaults (lr 1e-3, wd 0) with no params; in float32 against
  # the float64 reference, to the float32 rounding of the update.
  # multi_tensor_adam_cuda takes ``const float beta2``: 1 - 0.999f is
  # 1.3e-5 (relative) off 1 - 0.999, in DeepSpeed as in float32 here.
  group = _group(betas=(float(np.float32(0.9)), float(np.float32(0.999))))
  ref_opt = RefFusedAdam(group)
  rng = np.random.default_rng(1)
  tx = optimizer_from_deepspeed({"type": "Adam"}, None)
  ref = _flat(_params(rng))
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _params(
      np.random.default_rng(1)))
  state = tx.init(params)
  update = jax.jit(tx.update)
  for k in range(4):
    grads = _grads(rng, ref, k)
    start = {n: v.copy() for n, v in ref.items()}
    ref_opt.step(ref, grads)
    updates, state = update(
        jax.tree.map(lambda x: x.astype(jnp.float32), _unflat(grads, params)),
        state, params)
    assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(updates))
    step = _flat(updates)
    # The update itself, to float32 precision: relative to each element,
    # or to lr where the first moment cancels (m is a small difference).
    for name in ref:
      np.testing.assert_allclose(step[name], ref[name] - start[name],
                                 rtol=2e-6, atol=1e-6 * group["lr"])
    params = optax.apply_updates(params, updates)
    ref = {n: v.astype(np.float64) for n, v in _flat(params).items()}


@pytest.mark.parametrize("amsgrad", [False, True])
def test_torch_adamw(amsgrad):
  # torch.optim.AdamW: weight_decay defaults to 0.01, not FusedAdam's 0.
  params = {"lr": 0.02, "torch_adam": True, "amsgrad": amsgrad}
  group = _group(lr=0.02, weight_decay=0.01)
  _compare({"type": "AdamW", "params": params}, None,
           RefTorchAdam(group, decoupled=True, amsgrad=amsgrad), group)


def test_torch_adam_l2_amsgrad():
  params = {"lr": 0.02, "torch_adam": True, "adam_w_mode": False,
            "weight_decay": _WD, "amsgrad": True, "betas": [0.5, 0.9]}
  group = _group(lr=0.02, weight_decay=_WD, betas=(0.5, 0.9))
  _compare({"type": "Adam", "params": params}, None,
           RefTorchAdam(group, decoupled=False, amsgrad=True), group)


@pytest.mark.parametrize("inside", [False, True])
def test_fused_lamb(inside):
  # |p| / |u| <= 1 / weight_decay: 0.01 lets it pass max_coeff.
  params = {"lr": 0.01, "weight_decay": 0.01, "eps_inside_sqrt": inside,
            "betas": [0.85, 0.98]}
  group = _group(lr=0.01, weight_decay=0.01, betas=(0.85, 0.98),
                 max_coeff=10.0, min_coeff=0.01)
  ref = _compare({"type": "Lamb", "params": params}, None,
                 RefFusedLamb(group, inside), group, kind="lamb")
  # The clamps and the zero-norm case (step 0) were all exercised.
  assert {10.0, 0.01, 1.0} <= set(ref.coeffs), ref.coeffs


def test_fused_lamb_coefficients_and_no_bias_correction():
  params = {"lr": 0.01, "max_coeff": 2.0, "min_coeff": 0.5,
            "bias_correction": False}
  group = _group(lr=0.01, max_coeff=2.0, min_coeff=0.5,
                 bias_correction=False)
  ref = _compare({"type": "lamb", "params": params}, None,
                 RefFusedLamb(group), group, kind="lamb")
  assert {2.0, 0.5} <= set(ref.coeffs), ref.coeffs


def test_fused_lion():
  # A leaf that never gets a gradient has c == 0: FusedLion moves it by
  # +lr (``c > 0 ? -lr : lr``), as the reference does.
  params = {"lr": 0.01, "weight_decay": _WD, "betas": [0.9, 0.99]}
  group = _group(lr=0.01, weight_decay=_WD, betas=(0.9, 0.99))
  _compare({"type": "Lion", "params": params}, None, RefFusedLion(group),
           group, kind="zero_grad")


@pytest.mark.parametrize("nesterov", [False, True])
def test_torch_sgd(nesterov):
  params = {"lr": 0.05, "momentum": 0.9, "weight_decay": _WD,
            "nesterov": nesterov}
  if not nesterov:
    params["dampening"] = 0.3
  group = dict(lr=0.05, momentum=0.9, dampening=params.get("dampening", 0.0),
               weight_decay=_WD, nesterov=nesterov)
  _compare({"type": "SGD", "params": params}, None, RefTorchSGD(group),
           group)


def test_torch_sgd_without_momentum():
  group = dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
               nesterov=False)
  _compare({"type": "sgd"}, None, RefTorchSGD(group), group)


def test_torch_adagrad():
  params = {"lr": 0.1, "lr_decay": 0.05, "weight_decay": _WD,
            "initial_accumulator_value": 0.2, "eps": 1e-6}
  group = dict(params)
  _compare({"type": "Adagrad", "params": params}, None,
           RefTorchAdagrad(group), group)


def test_adagrad_defaults():
  group = dict(lr=1e-2, lr_decay=0.0, weight_decay=0.0,
               initial_accumulator_value=0.0, eps=1e-10)
  _compare({"type": "adagrad"}, None, RefTorchAdagrad(group), group)


# ---------------------------------------------------------------------------
# Optimizer and schedule together: the schedule overwrites lr (and betas).


def test_adamw_with_warmup_decay():
  sched = {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02,
           "warmup_num_steps": 3, "total_num_steps": 7,
           "warmup_type": "linear"}
  group = _group(lr=5.0, weight_decay=_WD)  # lr is replaced by the schedule
  _compare({"type": "AdamW", "params": {"lr": 5.0, "weight_decay": _WD}},
           {"type": "WarmupDecayLR", "params": sched},
           RefFusedAdam(group), group,
           sched=lambda g: RefWarmupDecayLR(g, **sched), steps=9)


def test_lamb_with_warmup_cosine_scales_the_optimizer_lr():
  sched = {"total_num_steps": 8, "warmup_num_steps": 3,
           "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05}
  group = _group(lr=0.02, weight_decay=_WD, max_coeff=10.0, min_coeff=0.01)
  _compare({"type": "Lamb", "params": {"lr": 0.02, "weight_decay": _WD}},
           {"type": "WarmupCosineLR", "params": sched},
           RefFusedLamb(group), group,
           sched=lambda g: RefWarmupCosineLR(g, **sched), steps=10,
           kind="lamb")


def test_sgd_with_warmup_lr_defaults_to_the_optimizer_lr():
  sched = {"warmup_num_steps": 4}
  group = dict(lr=0.05, momentum=0.5, dampening=0.0, weight_decay=_WD,
               nesterov=False)
  _compare({"type": "SGD", "params": {"lr": 0.05, "momentum": 0.5,
                                      "weight_decay": _WD}},
           {"type": "WarmupLR", "params": sched}, RefTorchSGD(group), group,
           sched=lambda g: RefWarmupLR(g, **sched), steps=7)


_CYCLE = {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01,
          "cycle_first_step_size": 3, "cycle_second_step_size": 2,
          "decay_step_size": 2, "decay_lr_rate": 0.5,
          "cycle_min_mom": 0.85, "cycle_max_mom": 0.95,
          "decay_mom_rate": 0.01}


@pytest.mark.parametrize("torch_adam", [False, True])
def test_adam_with_one_cycle_cycles_beta1(torch_adam):
  # OneCycle sets betas = (momentum, 0.99): the configured beta2 is lost.
  group = _group(lr=0.3, weight_decay=_WD, betas=(0.5, 0.5))
  ref = (RefTorchAdam(group, decoupled=True, amsgrad=False) if torch_adam
         else RefFusedAdam(group))
  _compare({"type": "AdamW",
            "params": {"lr": 0.3, "weight_decay": _WD, "betas": [0.5, 0.5],
                       "torch_adam": torch_adam}},
           {"type": "OneCycle", "params": _CYCLE}, ref, group,
           sched=lambda g: RefOneCycle(g, **_CYCLE), steps=10)


def test_lion_with_one_cycle_stairs():
  cycle = dict(_CYCLE, cycle_first_stair_count=2, cycle_second_stair_count=1)
  group = _group(lr=0.3, weight_decay=_WD)
  _compare({"type": "Lion", "params": {"lr": 0.3, "weight_decay": _WD}},
           {"type": "OneCycle", "params": cycle}, RefFusedLion(group), group,
           sched=lambda g: RefOneCycle(g, **cycle), steps=9)


def test_adam_with_one_cycle_without_momentum():
  cycle = dict(_CYCLE, cycle_momentum=False)
  group = _group(lr=0.3, betas=(0.7, 0.9))
  _compare({"type": "Adam", "params": {"lr": 0.3, "betas": [0.7, 0.9]}},
           {"type": "OneCycle", "params": cycle}, RefFusedAdam(group), group,
           sched=lambda g: RefOneCycle(g, **cycle), steps=8)


def test_sgd_with_one_cycle_turns_momentum_cycling_off():
  # OneCycle._initialize_momentum: torch SGD has no 'betas' -> off, warned.
  group = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0,
               nesterov=False)
  with pytest.warns(UserWarning, match=re.escape(
      "'scheduler.params.cycle_momentum' has no effect with "
      "torch.optim.SGD")):
    _compare({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
             {"type": "OneCycle", "params": _CYCLE}, RefTorchSGD(group),
             group, sched=lambda g: RefOneCycle(g, has_betas=False,
                                                **_CYCLE), steps=8)


# ---------------------------------------------------------------------------
# Schedules alone, at every step across the warmup / cycle / decay edges.

_SCHEDULES = [
    ("WarmupLR", {}),
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                  "warmup_num_steps": 5}),
    ("WarmupLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 5,
                  "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 1}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 4}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 4,
                       "warmup_min_lr": 1e-4, "warmup_max_lr": 0.1,
                       "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 3, "warmup_num_steps": 5}),
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 4}),
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 4,
                        "warmup_min_ratio": 0.2, "cos_min_ratio": 0.1,
                        "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 4, "warmup_num_steps": 4}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                  "cycle_first_step_size": 4}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                  "cycle_first_step_size": 5, "cycle_second_step_size": 3,
                  "decay_step_size": 2, "decay_lr_rate": 0.3}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                  "cycle_first_step_size": 8, "cycle_second_step_size": 4,
                  "cycle_first_stair_count": 3,
                  "cycle_second_stair_count": 2}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                  "cycle_first_step_size": 6,
                  "cycle_first_stair_count": 4}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                  "cycle_first_step_size": 3, "cycle_second_step_size": 0}),
    ("LRRangeTest", {}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.01,
                     "lr_range_test_step_size": 3,
                     "lr_range_test_step_rate": 2.0}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.01,
                     "lr_range_test_step_size": 3,
                     "lr_range_test_staircase": True}),
]


@pytest.mark.parametrize("kind,params", _SCHEDULES,
                         ids=[f"{k}{i}" for i, (k, _) in
                              enumerate(_SCHEDULES)])
def test_schedule_matches_deepspeed(kind, params):
  base_lr = 0.03
  group = {"lr": base_lr, "betas": (0.9, 0.999)}
  ref = _REF_SCHEDULERS[kind](group, **params)
  expected, moms = [group["lr"]], [group["betas"]]
  for _ in range(30):
    ref.step()
    expected.append(group["lr"])
    moms.append(group["betas"])
  with jax.enable_x64(True):
    schedule = schedule_from_deepspeed({"type": kind, "params": params},
                                       base_lr)
    got = np.asarray(jax.jit(jax.vmap(schedule))(jnp.arange(31)))
  np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-300)
  assert len(set(np.round(expected, 12))) > 1  # not a constant
  if kind == "OneCycle":
    with jax.enable_x64(True):
      beta1 = parse_schedule({"type": kind, "params": params},
                             base_lr).beta1
      got_moms = np.asarray(jax.jit(jax.vmap(beta1))(jnp.arange(31)))
    np.testing.assert_allclose(got_moms, [m[0] for m in moms], rtol=1e-13)


def test_schedule_first_updates():
  # The first update's rate is set by the constructor: WarmupLR's min,
  # WarmupCosineLR's 0, OneCycle's cycle_min_lr.
  warm = schedule_from_deepspeed(
      {"type": "WarmupLR", "params": {"warmup_min_lr": 0.5,
                                      "warmup_max_lr": 1.0,
                                      "warmup_num_steps": 10}}, 0.1)
  assert float(warm(0)) == float(warm(1)) == 0.5 < float(warm(2))
  assert float(warm(11)) == 1.0
  cos = schedule_from_deepspeed(
      {"type": "WarmupCosineLR", "params": {"total_num_steps": 10,
                                            "warmup_num_steps": 2,
                                            "warmup_min_ratio": 0.5}}, 2.0)
  assert float(cos(0)) == 0.0 and float(cos(1)) == 1.0


def test_schedule_case_insensitive_and_float32():
  schedule = schedule_from_deepspeed(
      {"type": "warmupdecaylr", "params": {"total_num_steps": 10,
                                           "warmup_num_steps": 2}}, 1.0)
  assert schedule(3).dtype == jnp.float32
  np.testing.assert_allclose(schedule(5), 0.001 * (10 - 4) / 8, rtol=1e-6)


def test_learning_rate_is_reported():
  tx = optimizer_from_deepspeed({"type": "AdamW", "params": {"lr": 0.25}},
                                None)
  params = {"w": jnp.ones((2,))}
  state = tx.init(params)
  _, state = tx.update(params, state, params)
  assert float(state[1].hyperparams["learning_rate"]) == 0.25


# ---------------------------------------------------------------------------
# Errors name the dotted key and the fix.


def _raises(optimizer, scheduler, *fragments):
  with pytest.raises(ValueError) as info:
    optimizer_from_deepspeed(optimizer, scheduler)
  for fragment in fragments:
    assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("optimizer,scheduler,key", [
    ({"type": "AdamW", "params": {"lr": "auto"}}, None,
     "'optimizer.params.lr' is \"auto\""),
    ({"type": "AdamW", "params": {"betas": "auto"}}, None,
     "'optimizer.params.betas' is \"auto\""),
    ({"type": "AdamW", "params": {"betas": [0.9, "auto"]}}, None,
     "'optimizer.params.betas[1]' is \"auto\""),
    ({"type": "auto"}, None, "'optimizer.type' is \"auto\""),
    ({"type": "AdamW", "params": "auto"}, None,
     "'optimizer.params' is \"auto\""),
    ({"type": "AdamW"}, {"type": "WarmupDecayLR", "params": {
        "total_num_steps": "auto", "warmup_num_steps": 10}},
     "'scheduler.params.total_num_steps' is \"auto\""),
    ({"type": "AdamW"}, {"type": "WarmupLR", "params": {
        "warmup_max_lr": "auto"}},
     "'scheduler.params.warmup_max_lr' is \"auto\""),
])
def test_auto_is_refused(optimizer, scheduler, key):
  _raises(optimizer, scheduler, key, "write a number")


def test_no_optimizer():
  _raises(None, {"type": "WarmupLR"}, "a config scheduler needs a config "
          "optimizer", "schedule_from_deepspeed", "as tx")
  _raises(None, None, "no \"optimizer\" section", "tx")


@pytest.mark.parametrize("kind,fragment", [
    ("OneBitAdam", "\"type\": \"Adam\""),
    ("ZeroOneAdam", "\"type\": \"Adam\""),
    ("OneBitLamb", "\"type\": \"Lamb\""),
    ("MuAdam", "pass it as tx"),
    ("MuAdamW", "pass it as tx"),
    ("MuSGD", "pass it as tx"),
    ("Muon", "optax.contrib.muon"),
])
def test_refused_deepspeed_optimizers(kind, fragment):
  _raises({"type": kind}, None, "'optimizer.type'", repr(kind),
          "does not build", fragment)


def test_torch_optimizers_and_unknown_types():
  _raises({"type": "RMSprop"}, None, "'optimizer.type'", "torch.optim",
          "optax.rmsprop", "pass it as tx")
  _raises({"type": "Adafactor"}, None, "'optimizer.type'",
          "adam, adamw, lamb, lion, sgd, adagrad", "'Adafactor'")
  _raises({"type": 3}, None, "'optimizer.type' must be a string")
  _raises({"params": {}}, None, "'optimizer.type' is missing")
  _raises({"type": "Adam", "lr": 1}, None, "'optimizer.lr' is not a key",
          "type, params, legacy_fusion")
  _raises({"type": "Adam", "legacy_fusion": 1}, None,
          "'optimizer.legacy_fusion' must be true or false")
  # legacy_fusion is accepted.
  optimizer_from_deepspeed({"type": "Adam", "legacy_fusion": False}, None)


def test_scheduler_types():
  _raises({"type": "Adam"}, {"type": "CosineAnnealingLR", "params": {}},
          "'scheduler.type'", "torch.optim.lr_scheduler", "optax",
          "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest")
  _raises({"type": "Adam"}, {"type": "Cosine"}, "'scheduler.type'",
          "'Cosine'", "OneCycle")
  _raises({"type": "Adam"}, {}, "'scheduler.type' is missing")
  _raises({"type": "Adam"}, {"type": "WarmupLR", "when": 1},
          "'scheduler.when' is not a key")
  with pytest.raises(ValueError, match=re.escape("'scheduler.type'")):
    schedule_from_deepspeed({"type": "StepLR"}, 0.1)


@pytest.mark.parametrize("optimizer,fragments", [
    ({"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}},
     ["'optimizer.params.momentum' is not a parameter of DeepSpeed's "
      "FusedAdam", "accepted: lr, betas, eps, weight_decay, bias_correction"]),
    ({"type": "AdamW", "params": {"torch_adam": True,
                                  "bias_correction": False}},
     ["'optimizer.params.bias_correction' is not a parameter of "
      "torch.optim.Adam(W)", "no bias_correction"]),
    ({"type": "Lamb", "params": {"adam_w_mode": True}},
     ["'optimizer.params.adam_w_mode'", "FusedLamb", "max_coeff"]),
    ({"type": "SGD", "params": {"betas": [0.9, 0.9]}},
     ["'optimizer.params.betas'", "torch.optim.SGD", "nesterov"]),
    ({"type": "Adagrad", "params": {"momentum": 0.9}},
     ["'optimizer.params.momentum'", "torch.optim.Adagrad", "lr_decay"]),
    ({"type": "Lion", "params": {"eps": 1e-8}},
     ["'optimizer.params.eps'", "FusedLion"]),
    ({"type": "AdamW", "params": {"max_grad_norm": 1.0}},
     ["'optimizer.params.max_grad_norm'", "\"gradient_clipping\""]),
    ({"type": "AdamW", "params": {"amsgrad": True}},
     ["'optimizer.params.amsgrad' must be false with DeepSpeed's FusedAdam",
      "\"torch_adam\": true"]),
    ({"type": "Lamb", "params": {"amsgrad": True}},
     ["'optimizer.params.amsgrad' must be false", "FusedLamb"]),
    ({"type": "AdamW", "params": {"lr": "1e-3"}},
     ["'optimizer.params.lr' must be a finite number >= 0",
      "without quotes"]),
    ({"type": "AdamW", "params": {"lr": -1.0}},
     ["'optimizer.params.lr' must be a finite number >= 0"]),
    ({"type": "AdamW", "params": {"betas": 0.9}},
     ["'optimizer.params.betas' must be a list of two numbers"]),
    ({"type": "AdamW", "params": {"betas": [0.9, 1.0]}},
     ["'optimizer.params.betas[1]' must be a number in [0, 1)"]),
    ({"type": "AdamW", "params": {"torch_adam": "yes"}},
     ["'optimizer.params.torch_adam' must be true or false"]),
    ({"type": "AdamW", "params": {"adam_w_mode": 1}},
     ["'optimizer.params.adam_w_mode' must be true or false"]),
    ({"type": "SGD", "params": {"nesterov": True}},
     ["'optimizer.params.nesterov' must be false unless momentum > 0",
      "zero dampening"]),
    ({"type": "SGD", "params": {"nesterov": True, "momentum": 0.9,
                                "dampening": 0.1}},
     ["'optimizer.params.nesterov'"]),
    ({"type": "Adam", "params": [1]},
     ["'optimizer.params' must be a JSON object"]),
    ("adam", ["'optimizer' must be a JSON object"]),
])
def test_optimizer_param_errors(optimizer, fragments):
  _raises(optimizer, None, *fragments)


@pytest.mark.parametrize("scheduler,fragments", [
    ({"type": "WarmupDecayLR", "params": {}},
     ["'scheduler.params.total_num_steps' is missing"]),
    ({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2}},
     ["'scheduler.params.total_num_steps' is missing"]),
    ({"type": "OneCycle", "params": {"cycle_max_lr": 0.1}},
     ["'scheduler.params.cycle_min_lr' is missing", "no default"]),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}},
     ["'scheduler.params.cycle_max_lr' is missing"]),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1,
                                     "cycle_max_lr": 1,
                                     "cycle_first_step_size": 0}},
     ["'scheduler.params.cycle_first_step_size' must be a finite number > "
      "0"]),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1,
                                     "cycle_max_lr": 1,
                                     "cycle_max_mom": 1.5}},
     ["'scheduler.params.cycle_max_mom' must be a number in [0, 1)"]),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1,
                                     "cycle_max_lr": 1,
                                     "cycle_first_stair_count": 1.5}},
     ["'scheduler.params.cycle_first_stair_count' must be an integer"]),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1,
                                     "cycle_max_lr": 1,
                                     "cycle_momentum": "true"}},
     ["'scheduler.params.cycle_momentum' must be true or false"]),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
     ["'scheduler.params.warmup_num_steps' must be an integer >= 1"]),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 10.0}},
     ["'scheduler.params.warmup_num_steps' must be an integer",
      "write 10"]),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}},
     ["'scheduler.params.warmup_type' must be \"log\" or \"linear\""]),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": -0.1}},
     ["'scheduler.params.warmup_max_lr' must be a finite number >= 0"]),
    ({"type": "WarmupLR", "params": {"warmup_steps": 10}},
     ["'scheduler.params.warmup_steps' is not a parameter of DeepSpeed's "
      "WarmupLR", "warmup_num_steps"]),
    ({"type": "WarmupLR", "params": {"last_batch_iteration": 5}},
     ["'scheduler.params.last_batch_iteration' must be -1",
      "remove the key"]),
    ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}},
     ["'scheduler.params.lr_range_test_step_size' must be an integer >= 1"]),
    ({"type": "LRRangeTest", "params": {"lr_range_test_staircase": 1}},
     ["'scheduler.params.lr_range_test_staircase' must be true or false"]),
    ({"type": "WarmupLR", "params": [1]},
     ["'scheduler.params' must be a JSON object"]),
])
def test_scheduler_param_errors(scheduler, fragments):
  _raises({"type": "AdamW"}, scheduler, *fragments)
  with pytest.raises(ValueError) as info:
    schedule_from_deepspeed(scheduler, 0.1)
  assert fragments[0] in str(info.value)


def test_scheduler_defaults_need_no_params():
  # DeepSpeed's constructor defaults: WarmupLR needs nothing.
  tx = optimizer_from_deepspeed({"type": "AdamW"}, {"type": "WarmupLR"})
  assert isinstance(tx, optax.GradientTransformation)
  with pytest.raises(ValueError, match=re.escape("base_lr must be")):
    schedule_from_deepspeed({"type": "WarmupLR"}, -1.0)


def test_weight_decay_needs_params():
  tx = optimizer_from_deepspeed(
      {"type": "AdamW", "params": {"weight_decay": 0.1}}, None)
  params = {"w": jnp.ones((2,))}
  with pytest.raises(ValueError, match="needs the parameters"):
    tx.update(params, tx.init(params))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    lamb = optimizer_from_deepspeed({"type": "Lamb"}, None)
  with pytest.raises(ValueError, match="Lamb's update needs the parameters"):
    lamb.update(params, lamb.init(params))


def test_auto_is_refused_however_it_is_spelled():
  # The reader takes " Auto " as "auto"; so does the optimizer's check.
  with pytest.raises(ValueError, match=r"'optimizer\.params\.lr' is \"auto\""):
    optimizer_from_deepspeed(
        {"type": "AdamW", "params": {"lr": " Auto "}}, None)
