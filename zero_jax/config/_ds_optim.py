"""The optax transformation of a DeepSpeed config's ``optimizer`` and
``scheduler`` sections, with DeepSpeed's own formulas.

DeepSpeed builds its optimizer in ``DeepSpeedEngine._configure_basic_optimizer``
(``deepspeed/runtime/engine.py``) and its schedule in
``deepspeed/runtime/lr_schedules.py``. This module rebuilds both as optax
transformations that give the same parameters, step for step:

* ``Adam`` / ``AdamW``: DeepSpeed's FusedAdam
  (``csrc/adam/multi_tensor_adam.cu``) or, with ``torch_adam``,
  ``torch.optim.Adam`` / ``AdamW``. ``Adam`` means AdamW unless
  ``adam_w_mode`` is false (``ADAM_W_MODE_DEFAULT = True``).
* ``Lamb``: FusedLamb (``csrc/lamb/fused_lamb_cuda_kernel.cu``): the trust
  ratio is taken from the moments *before* bias correction and clamped to
  ``[min_coeff, max_coeff]``; bias correction scales the step.
* ``Lion``: FusedLion (``csrc/lion/multi_tensor_lion.cu``).
* ``SGD`` and ``Adagrad``: ``torch.optim.SGD`` / ``torch.optim.Adagrad``,
  which DeepSpeed uses when the optimizer state is not offloaded.

The arithmetic is in ``_ds_transforms``, the schedules (which replace the
learning rate of every update, as DeepSpeed's scheduler overwrites
``param_group["lr"]``) in ``_ds_schedules``. OneCycle's momentum cycle sets
Adam's, Lamb's and Lion's ``betas`` the same way. Sources: DeepSpeed's
master branch at commit edaa722 (after v0.19.5).
"""

from __future__ import annotations

from typing import Any, Mapping
import warnings

import optax

from zero_jax._checks import check_bool, fail
from zero_jax.config._ds_keys import key_name
from zero_jax.config._ds_schedules import (Params, Schedule, no_auto,
                                           parse_schedule, read_section)
# Re-exported: the callers of optimizer_from_deepspeed import these here.
from zero_jax.config._ds_schedules import (  # noqa: F401
    SCHEDULERS, schedule_from_deepspeed)
from zero_jax.config._ds_transforms import (Hyper, same_form, scale_by_adam,
                                            scale_by_lamb, scale_by_lion,
                                            scale_by_torch_adagrad,
                                            scale_by_torch_sgd)


# DeepSpeed's own optimizer names (``DEEPSPEED_OPTIMIZERS``, lowercased by
# ``DeepSpeedConfig``) and the torch.optim ones it falls back to, lowercased.
OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "lamb", "lion", "sgd",
                               "adagrad")

_TX_FIX = ("build the optimizer with optax and pass it as tx (drop the "
           "config's \"optimizer\" section)")

# Optimizers DeepSpeed knows that are not built here: why, and what to use.
_REFUSED_OPTIMIZERS: Mapping[str, str] = {
    "onebitadam": (
        "1-bit Adam compresses DeepSpeed's gradient all-reduce and freezes "
        "Adam's variance after freeze_step; zero_jax's collectives are XLA's "
        "and are not compressed. Use \"type\": \"Adam\" (the uncompressed "
        "update, not 1-bit Adam's frozen-variance phase)"),
    "zerooneadam": (
        "0/1 Adam compresses DeepSpeed's gradient all-reduce and skips "
        "variance updates by a policy; zero_jax's collectives are XLA's and "
        "are not compressed. Use \"type\": \"Adam\" (the uncompressed "
        "update)"),
    "onebitlamb": (
        "1-bit LAMB compresses DeepSpeed's gradient all-reduce and freezes "
        "the variance after freeze_step; zero_jax's collectives are XLA's "
        "and are not compressed. Use \"type\": \"Lamb\" (the uncompressed "
        "update)"),
    "muadam": (
        "MuAdam (the mup package) scales each parameter's rate by its "
        "infinite-width shape, which a JSON config does not carry; "
        + _TX_FIX),
    "muadamw": (
        "MuAdamW (the mup package) scales each parameter's rate by its "
        "infinite-width shape, which a JSON config does not carry; "
        + _TX_FIX),
    "musgd": (
        "MuSGD (the mup package) scales each parameter's rate by its "
        "infinite-width shape, which a JSON config does not carry; "
        + _TX_FIX),
    "muon": (
        "DeepSpeed's Muon splits parameters by a use_muon attribute set on "
        "each torch parameter, which a JSON config does not carry; build it "
        "with optax.contrib.muon and pass it as tx"),
}
# torch.optim classes DeepSpeed would build by name (``getattr(torch.optim,
# type)``) that are not built here, lowercased; value: the nearest optax.
_TORCH_OPTIMIZERS: Mapping[str, str] = {
    "rmsprop": "optax.rmsprop", "adadelta": "optax.adadelta",
    "adamax": "optax.adamax", "nadam": "optax.nadam",
    "radam": "optax.radam", "rprop": "optax.rprop", "asgd": "optax.sgd",
    "sparseadam": "optax.adam", "lbfgs": "optax.lbfgs",
}
# torch.optim.lr_scheduler classes DeepSpeed would build by name.


_ADAM = ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad",
         "adam_w_mode", "torch_adam", "set_grad_none")
_TORCH_ADAM = ("lr", "betas", "eps", "weight_decay", "amsgrad",
               "adam_w_mode", "torch_adam")
_OPTIMIZER_PARAMS = {
    "lamb": ("lr", "bias_correction", "betas", "eps", "eps_inside_sqrt",
             "weight_decay", "max_coeff", "min_coeff", "amsgrad"),
    "lion": ("lr", "betas", "weight_decay", "set_grad_none"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "adagrad": ("lr", "lr_decay", "weight_decay",
                "initial_accumulator_value", "eps"),
}
_OWNERS = {"lamb": "DeepSpeed's FusedLamb", "lion": "DeepSpeed's FusedLion",
           "sgd": "torch.optim.SGD", "adagrad": "torch.optim.Adagrad"}


def _optimizer_type(kind: str) -> str:
  lower = kind.lower()
  if lower in OPTIMIZERS:
    return lower
  if lower in _REFUSED_OPTIMIZERS:
    raise ValueError(f"{key_name('optimizer.type')} is {kind!r}, which "
                     f"zero_jax does not build: {_REFUSED_OPTIMIZERS[lower]}")
  if lower in _TORCH_OPTIMIZERS:
    raise ValueError(
        f"{key_name('optimizer.type')} is {kind!r}, a torch.optim class "
        f"that zero_jax does not rebuild: use {_TORCH_OPTIMIZERS[lower]} "
        "(check its formula against torch's) and pass it as tx; types "
        f"built from the config: {', '.join(OPTIMIZERS)}")
  fail(key_name("optimizer.type"),
       f"one of {', '.join(OPTIMIZERS)} (any case)", kind,
       "or " + _TX_FIX)


def _betas(p: Params, schedule: Schedule) -> tuple[Hyper, Hyper]:
  betas = p.betas((0.9, 0.999))
  if schedule.beta1 is None:
    return betas
  # OneCycle writes param_group["betas"] = (momentum, 0.99).
  return schedule.beta1, 0.99


def _direction(kind: str, params: Any, scheduler: Any
               ) -> tuple[optax.GradientTransformation, float,
                          Schedule | None]:
  """The update before the learning rate, the optimizer's own ``lr``, and
  the schedule (None: constant ``lr``)."""
  prefix = "optimizer.params"
  fix = "remove it or check the spelling"
  if isinstance(params, Mapping) and "max_grad_norm" in params:
    raise ValueError(
        f"{key_name(prefix + '.max_grad_norm')} is refused, as DeepSpeed "
        "refuses it: write the top-level key \"gradient_clipping\" instead")
  if kind in ("adam", "adamw"):
    torch_adam = False
    if isinstance(params, Mapping) and "torch_adam" in params:
      torch_adam = check_bool(
          key_name(prefix + ".torch_adam"),
          no_auto(prefix + ".torch_adam", params["torch_adam"]),
          what="true or false")
    owner = ("torch.optim.Adam(W) (torch_adam is true)" if torch_adam
             else "DeepSpeed's FusedAdam")
    p = Params(params, prefix, _TORCH_ADAM if torch_adam else _ADAM, owner,
                fix + (" (torch.optim.Adam has no bias_correction or "
                       "set_grad_none)" if torch_adam else ""))
    # DeepSpeed: "adamw" forces decoupled decay; "adam" unless adam_w_mode
    # is false (ADAM_W_MODE_DEFAULT = True).
    w_mode = p.flag("adam_w_mode", True) or kind == "adamw"
    amsgrad = p.flag("amsgrad", False)
    if amsgrad and not torch_adam:
      fail(key_name(p.path("amsgrad")), "false with DeepSpeed's FusedAdam",
           True, "FusedAdam raises 'does not support the AMSGrad variant'; "
           "set \"torch_adam\": true for torch.optim.Adam(W)'s AMSGrad")
    lr = p.number("lr", 1e-3)
    # torch.optim.AdamW's weight_decay defaults to 0.01; FusedAdam's and
    # torch.optim.Adam's to 0.
    wd = p.number("weight_decay", 0.01 if torch_adam and w_mode else 0.0)
    eps = p.number("eps", 1e-8)
    bias = p.flag("bias_correction", True)
    p.flag("set_grad_none", True)  # when grads are freed: no effect here
    schedule = parse_schedule(scheduler, lr) if scheduler is not None else None
    b1, b2 = _betas(p, schedule or Schedule(None))
    return (scale_by_adam(b1, b2, eps, wd, w_mode, bias, amsgrad), lr,
            schedule)
  p = Params(params, prefix, _OPTIMIZER_PARAMS[kind], _OWNERS[kind], fix)
  if kind == "lamb":
    if p.flag("amsgrad", False):
      fail(key_name(p.path("amsgrad")), "false", True,
           "DeepSpeed's FusedLamb does not support the AMSGrad variant")
    lr = p.number("lr", 1e-3)
    schedule = parse_schedule(scheduler, lr) if scheduler is not None else None
    b1, b2 = _betas(p, schedule or Schedule(None))
    min_coeff = p.number("min_coeff", 0.01)
    tx = scale_by_lamb(
        b1, b2, p.number("eps", 1e-8), p.flag("eps_inside_sqrt", False),
        p.number("weight_decay", 0.0), p.flag("bias_correction", True),
        p.number("max_coeff", 10.0), min_coeff)
    return tx, lr, schedule
  if kind == "lion":
    lr = p.number("lr", 1e-3)
    schedule = parse_schedule(scheduler, lr) if scheduler is not None else None
    b1, b2 = _betas(p, schedule or Schedule(None))
    p.flag("set_grad_none", True)
    return (scale_by_lion(b1, b2, p.number("weight_decay", 0.0)), lr,
            schedule)
  if kind == "sgd":
    lr = p.number("lr", 1e-3)
    momentum = p.number("momentum", 0.0)
    dampening = p.number("dampening", 0.0)
    nesterov = p.flag("nesterov", False)
    if nesterov and (momentum <= 0 or dampening != 0):
      fail(key_name(p.path("nesterov")), "false unless momentum > 0 and "
           "dampening is 0", True, "torch.optim.SGD raises 'Nesterov "
           "momentum requires a momentum and zero dampening'")
    tx = scale_by_torch_sgd(momentum, dampening,
                             p.number("weight_decay", 0.0), nesterov)
  else:  # adagrad
    lr = p.number("lr", 1e-2)
    tx = scale_by_torch_adagrad(
        p.number("lr_decay", 0.0), p.number("weight_decay", 0.0),
        p.number("initial_accumulator_value", 0.0),
        p.number("eps", 1e-10))
  schedule = parse_schedule(scheduler, lr) if scheduler is not None else None
  if schedule is not None and schedule.beta1 is not None:
    # DeepSpeed's OneCycle._initialize_momentum: no 'betas' in the torch
    # optimizer's defaults -> cycle_momentum is turned off with a warning.
    warnings.warn(
        f"{key_name('scheduler.params.cycle_momentum')} has no effect with "
        f"{_OWNERS[kind]}, which has no betas: DeepSpeed turns the "
        "momentum cycle off for it too; set it to false to silence this",
        stacklevel=3)
  return tx, lr, schedule


def optimizer_from_deepspeed(optimizer: Mapping[str, Any] | None,
                             scheduler: Mapping[str, Any] | None
                             ) -> optax.GradientTransformation:
  """The optax transformation of DeepSpeed's ``optimizer`` and
  ``scheduler`` config sections, with DeepSpeed's formulas.

  Types (case-insensitive) and their params, with DeepSpeed's defaults:

  * ``Adam`` / ``AdamW`` (FusedAdam): ``lr`` (1e-3), ``betas``
    ([0.9, 0.999]), ``eps`` (1e-8), ``weight_decay`` (0),
    ``bias_correction`` (true), ``adam_w_mode`` (true: decoupled weight
    decay; false: L2 added to the gradient; ``AdamW`` is always
    decoupled), ``amsgrad`` (false only), ``set_grad_none`` (no effect).
    With ``torch_adam`` true: torch.optim.Adam / AdamW, whose
    ``weight_decay`` defaults to 0.01 for AdamW, with ``amsgrad``, and
    without ``bias_correction``.
  * ``Lamb`` (FusedLamb): ``lr`` (1e-3), ``betas``, ``eps`` (1e-8),
    ``eps_inside_sqrt`` (false), ``weight_decay`` (0),
    ``bias_correction`` (true), ``max_coeff`` (10), ``min_coeff`` (0.01).
  * ``Lion`` (FusedLion): ``lr`` (1e-3), ``betas`` ([0.9, 0.999]),
    ``weight_decay`` (0, decoupled).
  * ``SGD`` (torch.optim.SGD): ``lr`` (1e-3), ``momentum`` (0),
    ``dampening`` (0), ``weight_decay`` (0, added to the gradient),
    ``nesterov`` (false).
  * ``Adagrad`` (torch.optim.Adagrad): ``lr`` (1e-2), ``lr_decay`` (0),
    ``weight_decay`` (0), ``initial_accumulator_value`` (0), ``eps``
    (1e-10).

  A scheduler (see ``schedule_from_deepspeed``) replaces ``lr`` for every
  update; OneCycle's momentum cycle sets beta1 (and beta2 to 0.99) of
  Adam, Lamb and Lion, and is off for SGD and Adagrad, as in DeepSpeed.
  The learning rate is injected with ``optax.inject_hyperparams``, so the
  engine reports the rate of each update.

  Args:
    optimizer: the ``optimizer`` section, ``{"type": ..., "params":
      {...}}`` (``legacy_fusion`` is accepted and has no effect).
    scheduler: the ``scheduler`` section, or None.

  Returns:
    The optax transformation.

  Raises:
    ValueError: no optimizer section; a scheduler without one; an unknown
      or refused type or param, a value of the wrong type or range, or
      ``"auto"``; the message names the dotted key and the fix.
  """
  if optimizer is None:
    if scheduler is not None:
      raise ValueError(
          "the DeepSpeed config has a \"scheduler\" section but no "
          "\"optimizer\": a config scheduler needs a config optimizer here. "
          "Add an \"optimizer\" section, or pass the schedule as "
          "learning_rate of your own optax optimizer (e.g. "
          "schedule_from_deepspeed(config[\"scheduler\"], base_lr)) and "
          "pass that as tx")
    raise ValueError(
        "the DeepSpeed config has no \"optimizer\" section: add one (e.g. "
        "{\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}}) or pass an optax "
        "optimizer as tx")
  kind, params = read_section(optimizer, "optimizer",
                              ("legacy_fusion",))
  if "legacy_fusion" in optimizer:
    # Selects DeepSpeed's fp16 wrapper's fused path: no effect on the math.
    check_bool(key_name("optimizer.legacy_fusion"),
               no_auto("optimizer.legacy_fusion",
                        optimizer["legacy_fusion"]), what="true or false")
  direction, lr, schedule = _direction(_optimizer_type(kind), params,
                                       scheduler)
  rate = lr if schedule is None else schedule.lr
  # (The chain keeps its direction's FusedForm: the fused host optimizer
  # runs FusedAdam and FusedLion.)
  return same_form(optax.chain(
      direction,
      optax.inject_hyperparams(optax.scale_by_learning_rate)(
          learning_rate=rate)), direction)
