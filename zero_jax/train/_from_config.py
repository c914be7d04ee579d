"""``initialize``: DeepSpeed's ``deepspeed.initialize`` for zero_jax.

One call from a DeepSpeed config (a path, a dict, or a ``ZeroConfig``) to a
training-ready engine and its first state: the config is read with
``zero_jax.config.read_deepspeed`` (HuggingFace's ``"auto"`` filled in from
the keywords the Trainer would fill it from), the optax transformation is
built from its ``optimizer`` and ``scheduler`` sections unless one is
passed, and the parameters are laid out on the mesh.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Mapping

import optax
from jax.sharding import Mesh

from zero_jax.config import (ZeroConfig, optimizer_from_deepspeed,
                             read_deepspeed, schedule_from_deepspeed)
from zero_jax.layout import make_mesh
from zero_jax.train._engine import Engine
from zero_jax.train._state import TrainState

# ``tx(learning_rate) -> optax.GradientTransformation``: a client optimizer
# whose learning rate a config ``scheduler`` drives, as DeepSpeed's does.
TxFactory = Callable[[Any], optax.GradientTransformation]

_FACTORY = ("pass tx as a factory of the learning rate instead, e.g. "
            "tx=lambda lr: optax.adamw(lr), and zj.initialize calls it with "
            "the config's schedule")


def initialize(loss_fn: Callable[..., Any], params: Any,
               config: str | os.PathLike | Mapping[str, Any] | ZeroConfig,
               mesh: Mesh | None = None,
               tx: optax.GradientTransformation | TxFactory | None = None,
               *,
               unsupported: str = "error", has_aux: bool = False,
               with_rng: bool = False, loss_scope: str | None = None,
               **known: Any) -> tuple[Engine, TrainState]:
  """Builds the engine and its first state from a DeepSpeed config.

  zero_jax's ``deepspeed.initialize``: as there, the optimizer comes from
  the config's ``optimizer`` section (and its learning rate from the
  ``scheduler`` section) or from the caller, not both. The config's
  ``"auto"`` values are filled in from ``known``, named as HuggingFace's
  Trainer names the arguments it fills them from (``AUTO_KEYWORDS`` of
  ``zero_jax/config/_ds_auto.py``); a batch size the other two determine
  is derived on the mesh's devices (``train = micro x accum x devices``).
  Its warnings (the config's keys without effect, ...) point at the line
  that called it.

  Example::

    import zero_jax as zj
    zj.simulate_cpu_devices(8)
    engine, state = zj.initialize(
        loss_fn, params, "ds_config.json",
        per_device_train_batch_size=2, gradient_accumulation_steps=1,
        learning_rate=3e-4, max_steps=1000, warmup_steps=100)
    state, metrics = engine.step(state, batch)  # forward, backward, update

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss``, as for ``Engine``.
    params: the initial parameters (any pytree of floating arrays).
    config: a path to a DeepSpeed JSON file, the parsed dict, or a
      ``ZeroConfig`` (then ``tx`` is required).
    mesh: the mesh to shard over; None: ``make_mesh()`` over every device.
    tx: an optax transformation; or a factory ``tx(learning_rate) ->
      optax.GradientTransformation`` (e.g. ``optax.adamw``), called with
      the config ``scheduler``'s schedule (DeepSpeed's scheduler driving a
      client optimizer) or, without one, with ``learning_rate``; None
      builds it from the config's ``optimizer`` and ``scheduler`` sections
      (``zero_jax.config.optimizer_from_deepspeed``).
    unsupported: ``"error"`` or ``"warn"``, for keys zero_jax does not
      honour (see ``from_deepspeed``).
    has_aux: ``loss_fn`` returns ``(loss, aux)`` (see ``Engine``).
    with_rng: ``loss_fn`` takes a per-step PRNG key (see ``Engine``).
    loss_scope: a DeepSpeed config's ``ZeroConfig.loss_scope`` (None:
      ``"global"``; see ``zero_jax.config.read_deepspeed``). A
      ``ZeroConfig`` carries its own.
    **known: the values that fill in ``"auto"``:
      ``per_device_train_batch_size``, ``gradient_accumulation_steps``,
      ``max_grad_norm``, ``learning_rate``, ``adam_beta1``, ``adam_beta2``,
      ``adam_epsilon``, ``weight_decay``, ``warmup_steps``,
      ``warmup_ratio``, ``max_steps``, ``fp16``, ``bf16``, ``hidden_size``;
      and ``remat_names`` for ``activation_checkpointing.cpu_checkpointing``.

  Returns:
    ``(engine, state)``: the ``Engine`` and ``engine.init(params)``.

  Raises:
    ValueError: both ``tx`` and a config ``optimizer`` are given, or
      neither; a plain ``tx`` is given with a config ``scheduler``; a
      factory needs ``learning_rate`` and it is not given; or the config
      cannot be read (every ``"auto"`` left is listed, with its keyword).
    TypeError: a keyword is not one of ``AUTO_KEYWORDS``, or keywords are
      given with a ``ZeroConfig``.
  """
  caught: list[warnings.WarningMessage] = []
  try:
    # Every warning from below is re-issued at the caller's line: those
    # raised deep in the engine point at zero_jax's own lines.
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      if isinstance(config, ZeroConfig):
        if known or loss_scope is not None:
          raise TypeError(
              f"initialize got {sorted(known) or ['loss_scope']} with a "
              "ZeroConfig: these fill in a DeepSpeed config's \"auto\" "
              "values and its loss scope, and a ZeroConfig has its own; "
              "drop them")
        zero, optimizer, scheduler = config, None, None
      else:
        read = read_deepspeed(config, unsupported=unsupported,
                              loss_scope=loss_scope or "global", **known)
        zero, optimizer, scheduler = (read.zero, read.optimizer,
                                      read.scheduler)
      tx = _transformation(tx, optimizer, scheduler,
                           known.get("learning_rate"))
      if mesh is None:
        mesh = make_mesh()
      engine = Engine(loss_fn, tx, zero, mesh, has_aux=has_aux,
                      with_rng=with_rng)
      return engine, engine.init(params)
  finally:
    _reissue(caught)


def _reissue(caught: list[warnings.WarningMessage]) -> None:
  """Issues the warnings ``initialize`` caught again, under the caller's
  filters: zero_jax's at the line that called ``initialize``, any other at
  its own line."""
  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for w in caught:
    if os.path.abspath(w.filename).startswith(package + os.sep):
      # (1: here, 2: initialize, 3: its caller.)
      warnings.warn(w.message, w.category, stacklevel=3)
    else:
      warnings.warn_explicit(w.message, w.category, w.filename, w.lineno,
                             source=w.source)


def _needs_base_lr(scheduler: Mapping[str, Any]) -> bool:
  """Whether the schedule reads the optimizer's lr: WarmupCosineLR scales
  it, and WarmupLR warms up to it when warmup_max_lr is not written."""
  kind = str(scheduler.get("type", "")).lower()
  params = scheduler.get("params") or {}
  return kind == "warmupcosinelr" or (
      kind == "warmuplr" and isinstance(params, Mapping) and
      params.get("warmup_max_lr") is None)


def _cycles_momentum(scheduler: Mapping[str, Any]) -> bool:
  """Whether ``scheduler`` is a OneCycle that cycles the momentum."""
  params = scheduler.get("params")
  kind = str(scheduler.get("type", "")).strip().lower()
  return kind == "onecycle" and (not isinstance(params, Mapping) or
                                 params.get("cycle_momentum", True) is not
                                 False)


def _transformation(tx: Any, optimizer: Mapping[str, Any] | None,
                    scheduler: Mapping[str, Any] | None,
                    learning_rate: float | None
                    ) -> optax.GradientTransformation:
  """The optax transformation: ``tx``, ``tx``'s factory called with the
  schedule or ``learning_rate``, or the config's optimizer."""
  factory = tx is not None and not isinstance(
      tx, optax.GradientTransformation) and callable(tx)
  if tx is not None and optimizer is not None:
    raise ValueError(
        "the DeepSpeed config has an 'optimizer' section and tx was passed "
        "too (DeepSpeed: do not provide an optimizer in the config and pass "
        "one): drop tx= to use the config's, or remove the config's "
        "'optimizer' section")
  if tx is None:
    if optimizer is None:
      raise ValueError(
          "no optimizer: the DeepSpeed config has no 'optimizer' section "
          "and no tx was passed; pass tx= (an optax transformation, e.g. "
          "optax.adamw(3e-4), or a factory of the learning rate, e.g. "
          "optax.adamw) or add an 'optimizer' section to the config")
    return optimizer_from_deepspeed(optimizer, scheduler)
  if not factory:
    if not isinstance(tx, optax.GradientTransformation):
      raise TypeError(
          "tx must be an optax.GradientTransformation or a factory "
          f"tx(learning_rate) -> optax.GradientTransformation, got "
          f"{type(tx).__name__}")
    if scheduler is not None:
      raise ValueError(
          "the DeepSpeed config has a 'scheduler' section and tx is an "
          "optax transformation, whose learning rate zero_jax cannot set: "
          + _FACTORY + " (or build it with learning_rate=zero_jax.config."
          "schedule_from_deepspeed(config['scheduler'], base_lr) and remove "
          "the config's 'scheduler' section)")
    return tx
  if scheduler is not None:
    if _cycles_momentum(scheduler):
      # DeepSpeed's OneCycle also sets a client optimizer's betas; a factory
      # of the learning rate cannot take them, and dropping the cycle
      # would train differently without a word.
      raise ValueError(
          "DeepSpeed config key 'scheduler.params.cycle_momentum' is true "
          "(OneCycle's default): the cycle sets the optimizer's beta1 every "
          "step, which a factory of the learning rate cannot take; set "
          "\"cycle_momentum\": false, or add an 'optimizer' section so "
          "that zero_jax builds the optimizer with the cycle")
    if learning_rate is None and _needs_base_lr(scheduler):
      raise ValueError(
          f"the DeepSpeed config's scheduler ({scheduler.get('type')!r}) "
          "starts from the optimizer's lr, and the config has no "
          "'optimizer' section to give it: pass learning_rate=... (your "
          "optimizer's base rate, as HF's Trainer's learning_rate)")
    rate = schedule_from_deepspeed(
        scheduler, 0.0 if learning_rate is None else learning_rate)
  elif learning_rate is None:
    raise ValueError(
        "tx is a factory of the learning rate, and the DeepSpeed config has "
        "no 'scheduler' or 'optimizer' section to give one: pass "
        "learning_rate=... (or pass tx as an optax transformation)")
  else:
    rate = learning_rate
  made = tx(rate)
  if not isinstance(made, optax.GradientTransformation):
    raise TypeError(
        f"tx(learning_rate) returned {type(made).__name__}, not an "
        "optax.GradientTransformation: pass a factory such as optax.adamw, "
        "or lambda lr: optax.chain(..., optax.adamw(lr))")
  return made
