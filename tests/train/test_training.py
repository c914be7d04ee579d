"""Training features: accumulation, clipping, loss scaling, offload, lr."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from tests import _models as m
from tests.train import _shared
from zero_jax.train import _loss_scale as ls
from zero_jax.analysis import compiled_memory, param_count

STAGES = [0, 1, 2, 3]


def _engine(loss_fn, tx, devices=8, **config):
  config.setdefault("min_shard_elements", 0)
  return zj.Engine(loss_fn, tx, zj.ZeroConfig(**config),
                   zj.make_mesh(num_devices=devices))


def _snapshot(state):
  return [np.array(x) for x in jax.tree.leaves(state)]


# ------------------------------------------------------------ accumulation


@pytest.mark.parametrize("stage", STAGES)
def test_accumulation_equals_one_step_on_the_global_batch(stage):
  # Global batch 32 on 8 devices in 4 micro-batches: 1 example per device
  # per micro-batch.
  loss_fn, params, batches = m.MODELS["mlp"]()
  ref_losses, ref_params = m.cached_reference("mlp", "adamw")
  engine = _engine(loss_fn, m.OPTIMIZERS["adamw"](), stage=stage,
                   grad_accum_steps=4)
  losses, out, _ = m.train_engine(engine, params, batches)
  m.assert_matches(losses, out, ref_losses, ref_params)


def test_accumulation_gpt_stage3_with_aux():
  loss_fn, params, batches = _shared.setup("gpt", _shared.GPT_STEPS)
  tx = m.OPTIMIZERS["adamw"](m.LR_SCALE["gpt"])
  ref_losses, ref_params = _shared.reference("gpt", "adamw",
                                             _shared.GPT_STEPS)

  def with_aux(p, b):
    return loss_fn(p, b), {"first_token": jnp.mean(b["tokens"][:, 0]
                                                   .astype(jnp.float32))}

  engine = zj.Engine(with_aux, tx, zj.ZeroConfig(stage=3, grad_accum_steps=2),
                     zj.make_mesh(num_devices=8), has_aux=True)
  state = engine.init(params)
  losses = []
  for b in batches:
    state, metrics = engine.step(state, b)
    losses.append(float(metrics["loss"]))
    # aux is averaged over micro-batches and devices: the global mean.
    np.testing.assert_allclose(metrics["aux"]["first_token"],
                               b["tokens"][:, 0].mean(), rtol=1e-6)
  m.assert_matches(losses, engine.gather_params(state), ref_losses,
                   ref_params)


@functools.cache
def _gpt128():
  loss_fn, params, _ = m.gpt_setup(d_model=128, n_layers=4, steps=1)
  return loss_fn, params


def _accum_temp(stage, accum, loss_scope="global"):
  """Step temporaries at a fixed micro-batch (2 sequences per device)."""
  loss_fn, params = _gpt128()
  # (Without prefetch: with it, this CPU-compiled step's temp grows by
  # 2.1 MB more under accumulation, as much as its layers' fp32
  # parameters; not yet explained, noted in issue 30.)
  engine = _engine(loss_fn, m.OPTIMIZERS["adamw"](), stage=stage,
                   grad_accum_steps=accum, min_shard_elements=1024,
                   prefetch=False, loss_scope=loss_scope)
  batch = {"tokens": np.zeros((16 * accum, 17), np.int32)}
  # (Lowered from the state's shapes and shardings: init compiles nothing.)
  state = engine.abstract_state(params)
  with jax.set_mesh(engine.mesh):
    mem = compiled_memory(engine.step.lower(state, batch).compile())
  return mem.temp, engine, param_count(params)


@pytest.mark.parametrize("stage,loss_scope", [
    (1, "per_device"), (1, "global"), (2, "global"), (3, "global")])
def test_accumulator_is_a_shard_but_at_the_per_device_stage_1(stage,
                                                               loss_scope):
  one, engine, psi = _accum_temp(stage, 1, loss_scope)
  four, _, _ = _accum_temp(stage, 4, loss_scope)
  extra = four - one
  if loss_scope == "per_device":
    # The per-device stages 0-1 accumulate each device's full gradient: a
    # full fp32 copy.
    assert extra >= 0.9 * 4 * psi
  else:
    # A global loss's micro-batch gradients are summed into the update's
    # layout, sharded from stage 1: the accumulator is fp32 shards, plus
    # the small replicated leaves' gradients.
    rep = engine.param_plan.replicated_elements
    accumulator = 4 * ((psi - rep) / engine.n + rep)
    assert extra <= 1.3 * accumulator, (extra, accumulator)
    assert extra <= 0.2 * 4 * psi


def test_batch_must_divide_into_micro_batches():
  loss_fn, params, batches = m.MODELS["mlp"]()
  engine = _engine(loss_fn, m.OPTIMIZERS["adamw"](), stage=2,
                   grad_accum_steps=3)
  state = engine.init(params)
  with pytest.raises(ValueError, match="multiple of 24"):
    engine.step(state, batches[0])  # 32 examples


def test_train_batch_size_is_enforced_and_resolved():
  loss_fn, params, batches = m.MODELS["mlp"]()
  engine = _engine(loss_fn, m.OPTIMIZERS["adamw"](), stage=1,
                   train_batch_size=32, micro_batch_size=2)
  assert engine.grad_accum_steps == 2
  state = engine.init(params)
  with pytest.raises(ValueError, match="train_batch_size 32"):
    engine.step(state, {k: v[:16] for k, v in batches[0].items()})
  with pytest.raises(ValueError, match="contradict"):
    _engine(loss_fn, m.OPTIMIZERS["adamw"](), stage=1, train_batch_size=32,
            micro_batch_size=2, grad_accum_steps=4)


# ---------------------------------------------------------------- clipping


@functools.cache
def _awkward_reference_norms(clip):
  """Single-device training of the awkward model, Adam clipped at
  ``clip``: the global norm of each step's gradient, the final
  parameters."""
  loss_fn, batches = m.awkward_loss, m.awkward_batches()
  tx = optax.chain(optax.clip_by_global_norm(clip), optax.adam(1e-2))

  @jax.jit  # (one program, not one per operation)
  def step(params, opt_state, b):
    g = jax.grad(loss_fn)(params, b)
    u, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, u), opt_state, optax.tree.norm(g)

  params = jax.device_put(m.awkward_params(), jax.devices()[0])
  opt_state = tx.init(params)
  norms = []
  for b in batches:
    params, opt_state, norm = step(params, opt_state, b)
    norms.append(float(norm))
  return norms, params


@pytest.mark.parametrize("stage,replica", [(s, 1) for s in STAGES] +
                         [(1, 2), (3, 2)])
def test_grad_norm_and_clipping_are_exact(stage, replica):
  # The awkward model keeps replicated leaves (indivisible shapes, a
  # scalar) next to sharded ones: both must count once in the norm.
  loss_fn, params, batches = (m.awkward_loss, m.awkward_params(),
                              m.awkward_batches())
  clip = 0.05
  ref_norms, ref_params = _awkward_reference_norms(clip)
  assert max(ref_norms) > clip  # clipping is active
  engine = zj.Engine(loss_fn, optax.adam(1e-2),
                     zj.ZeroConfig(stage=stage, clip_grad_norm=clip),
                     zj.make_mesh(num_devices=8, replica=replica))
  state = engine.init(params)
  assert engine.replicated_params()
  for b, ref in zip(batches, ref_norms):
    state, metrics = engine.step(state, b)
    assert abs(float(metrics["grad_norm"]) - ref) <= 1e-6 * ref
  assert m.rel_err(engine.gather_params(state), ref_params) <= 1e-5


# ------------------------------------------------------------ loss scaling


class _DeepSpeedDynamicLossScaler:
  """DeepSpeed's DynamicLossScaler.update_scale, transcribed."""

  def __init__(self, init_scale, scale_window, min_scale, delayed_shift,
               consecutive_hysteresis):
    self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
    self.scale_factor, self.scale_window = 2.0, scale_window
    self.min_scale, self.delayed_shift = min_scale, delayed_shift
    self.cur_hysteresis = delayed_shift
    self.consecutive_hysteresis = consecutive_hysteresis
    self.raised = False

  def update_scale(self, overflow):
    self.raised = False  # where DeepSpeed raises
    if overflow:
      if self.delayed_shift == 1 or self.cur_hysteresis == 1:
        if self.cur_scale == self.min_scale:
          self.raised = True
        self.cur_scale = max(self.cur_scale / self.scale_factor,
                             self.min_scale)
      else:
        self.cur_hysteresis -= 1
      self.last_overflow_iter = self.cur_iter
    else:
      if self.consecutive_hysteresis:
        self.cur_hysteresis = self.delayed_shift
      if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
        if not self.consecutive_hysteresis:
          self.cur_hysteresis = self.delayed_shift
        self.cur_scale *= self.scale_factor
    self.cur_iter += 1


@pytest.mark.parametrize("hysteresis,consecutive", [(1, False), (2, False),
                                                    (3, True)])
def test_loss_scale_rules_match_deepspeed(hysteresis, consecutive):
  cfg = zj.ZeroConfig(compute_dtype="float16", initial_scale_power=6,
                      loss_scale_window=4, hysteresis=hysteresis,
                      min_loss_scale=4.0, consecutive_hysteresis=consecutive)
  ds = _DeepSpeedDynamicLossScaler(2.0 ** 6, 4, 4.0, hysteresis, consecutive)
  state = ls.init(zj.layout.decide(cfg, zj.make_mesh()))
  update = jax.jit(functools.partial(ls.update, rules=cfg.loss_scaling))
  rng = np.random.default_rng(hysteresis)
  # Bursts of overflows and runs of clean steps, long enough to double.
  pattern = np.concatenate([rng.random(60) < 0.3, np.zeros(9, bool),
                            np.ones(12, bool), np.zeros(20, bool)])
  for i, overflow in enumerate(pattern):
    ds.update_scale(bool(overflow))
    state, at_min = update(state, jnp.array(not overflow))
    assert float(state.scale) == ds.cur_scale, f"step {i}"
    assert int(state.hysteresis) == ds.cur_hysteresis, f"step {i}"
    assert bool(at_min) == ds.raised, f"step {i}"
  assert int(state.skipped) == int(pattern.sum())


_BAD_COLUMN = 37  # of w1 (16, 64): its shard (dim 1, 8 columns) is device 4's
_BAD_EXAMPLE = 5  # of the 32-example batch: device 1's local batch


@jax.custom_vjp
def _poison(w, flag):
  return w


def _poison_fwd(w, flag):
  return w, flag


def _poison_bwd(flag, g):
  bad = jnp.zeros(g.shape, g.dtype).at[0, _BAD_COLUMN].set(jnp.inf)
  return g + jnp.where(flag > 0, bad, 0), jnp.zeros_like(flag)


_poison.defvjp(_poison_fwd, _poison_bwd)


def _poisonable_loss(params, batch):
  """The MLP loss; an inf enters one gradient element on the devices whose
  local batch holds a flagged example."""
  params = dict(params, w1=_poison(params["w1"], jnp.max(batch["flag"])))
  return m.mlp_loss(params, batch)


def _batches(steps, poison_at=()):
  out = []
  for i, b in enumerate(m.mlp_batches(steps)):
    flag = np.zeros((32,), np.float32)
    if i in poison_at:
      flag[_BAD_EXAMPLE] = 1.0
    out.append(dict(b, flag=flag))
  return out


def _fp16_engine(stage, **config):
  config = dict(dict(stage=stage, compute_dtype="float16",
                     initial_scale_power=8, hysteresis=1,
                     loss_scale_window=3), **config)
  return _engine(_poisonable_loss, m.OPTIMIZERS["adamw"](), **config)


@pytest.mark.parametrize("stage,offload", [(s, None) for s in STAGES] +
                         [(2, "device"), (3, "host")])
def test_overflow_on_one_device_skips_the_step_everywhere(stage, offload):
  # offload: the optimizer state in host memory, updated on the device or
  # on the host.
  extra = (dict(offload_optimizer="host", update_on=offload) if offload
           else {})
  engine = _fp16_engine(stage, **extra)
  state = engine.init(m.mlp_params())
  lp = engine.param_plan.leaves["w1"]
  if stage > 0:
    # The inf lands in a gradient shard that only device 4 holds.
    assert lp.sharded and lp.dim == 1 and lp.local_shape(8)[1] == 8
  batches = _batches(5, poison_at=(1,))
  state, metrics = engine.step(state, batches[0])
  assert not bool(metrics["skipped"]) and float(metrics["loss_scale"]) == 256
  before = _snapshot(dataclasses.replace(state, step=None, loss_scale=None))

  state, metrics = engine.step(state, batches[1])
  assert bool(metrics["skipped"]) and int(metrics["skipped_steps"]) == 1
  assert not np.isfinite(float(metrics["grad_norm"]))
  after = _snapshot(dataclasses.replace(state, step=None, loss_scale=None))
  for x, y in zip(before, after):
    np.testing.assert_array_equal(x, y)  # bit for bit, on every device
  assert int(state.step) == 2
  assert float(state.loss_scale.scale) == 128  # halved

  # loss_scale_window (3) clean steps later the scale doubles.
  scales = []
  for b in batches[2:]:
    state, metrics = engine.step(state, b)
    assert not bool(metrics["skipped"])
    scales.append(float(state.loss_scale.scale))
  assert scales == [128, 128, 256]
  assert int(state.loss_scale.skipped) == 1


def test_hysteresis_delays_halving():
  engine = _fp16_engine(3, hysteresis=2)
  state = engine.init(m.mlp_params())
  for b in _batches(2, poison_at=(0, 1)):
    state, metrics = engine.step(state, b)
    assert bool(metrics["skipped"])
    scale = float(state.loss_scale.scale)
  assert scale == 128  # unchanged after the first overflow, halved after 2nd


def test_overflow_at_minimum_scale_is_an_error():
  engine = _fp16_engine(2, min_loss_scale=256.0)
  state = engine.init(m.mlp_params())
  batches = _batches(2, poison_at=(0,))
  state, metrics = engine.step(state, batches[0])
  assert bool(metrics["skipped"])
  # The flag is internal to the step (read by the next call), not a metric.
  assert "overflow_at_min_scale" not in metrics
  with pytest.raises(FloatingPointError, match="minimum loss scale"):
    engine.step(state, batches[1])


def test_static_loss_scale_skips_but_keeps_scale():
  engine = _fp16_engine(1, loss_scale=512.0)
  state = engine.init(m.mlp_params())
  for b in _batches(2, poison_at=(0,)):
    state, metrics = engine.step(state, b)
  assert float(state.loss_scale.scale) == 512
  assert int(metrics["skipped_steps"]) == 1


_SCHEDULE = optax.linear_schedule(1e-2, 0.0, 10)


def _learning_rates(tx, config):
  """The learning_rate metric over 4 steps whose step 1 is skipped."""
  engine = zj.Engine(_poisonable_loss, tx,
                     zj.ZeroConfig(stage=2, hysteresis=1, **config),
                     zj.make_mesh(num_devices=8))
  state = engine.init(m.mlp_params())
  lrs = []
  for b in _batches(4, poison_at=(1,)):
    state, metrics = engine.step(state, b)
    lrs.append(float(metrics["learning_rate"]))
  return lrs


@pytest.mark.parametrize("config", [
    dict(compute_dtype="float16"), dict(compute_dtype="bfloat16"),
    dict(compute_dtype="bfloat16", offload_optimizer="host"),
    dict(compute_dtype="bfloat16", offload_optimizer="host",
         update_on="host")])
def test_learning_rate_metric_is_the_applied_updates_rate(config):
  # float16: the loss scale's overflow skips; bfloat16: skip_nonfinite's.
  # The schedule is given once, to optax; the rate is read from its state.
  tx = optax.inject_hyperparams(optax.adam)(learning_rate=_SCHEDULE)
  lrs = _learning_rates(tx, config)
  # The skipped step (1) applied nothing: the last rate applied stays.
  np.testing.assert_allclose(lrs, [_SCHEDULE(i) for i in (0, 0, 1, 2)],
                             rtol=1e-6)
