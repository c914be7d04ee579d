"""Flax adapters: scan_nnx and scan_linen run layers through scan_layers."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zero_jax as zj
from tests import _models as m
from zero_jax.layers import _flax as flax_layers
from zero_jax import analysis
from zero_jax.layers._flax import scan_linen, scan_nnx

D, L, OUT, N = 32, 3, 4, 8

# ------------------------------------------------------------------- models


class NNXBlock(nnx.Module):
  """Pre-LN residual MLP."""

  def __init__(self, d, *, dropout=0.0, rngs):
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 2 * d, rngs=rngs)
    self.down = nnx.Linear(2 * d, d, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None

  def __call__(self, x):
    y = self.down(jax.nn.gelu(self.up(self.ln(x))))
    return x + (self.drop(y) if self.drop is not None else y)


class NNXModel(nnx.Module):
  """Stacked blocks (the NNX scan-over-layers pattern) and a head.

  ``adapter``: run the blocks with scan_nnx, else with nnx.scan.
  """

  def __init__(self, adapter, *, n_layers=L, dropout=0.0, rngs):
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(rngs):
      return NNXBlock(D, dropout=dropout, rngs=rngs)

    self.blocks = create(rngs.split(n_layers))
    self.head = nnx.Linear(D, OUT, rngs=rngs)
    self.adapter = adapter

  def __call__(self, x):
    if self.adapter:
      h = scan_nnx(self.blocks, x)
    else:
      h = nnx.scan(lambda h, block: block(h), in_axes=(nnx.Carry, 0),
                   out_axes=nnx.Carry)(x, self.blocks)
    return self.head(h)


class LinenBlock(nn.Module):
  d: int

  @nn.compact
  def __call__(self, h, _):
    y = nn.Dense(2 * self.d)(nn.LayerNorm()(h))
    return h + nn.Dense(self.d)(jax.nn.gelu(y)), None


class LinenModel(nn.Module):
  """``adapter``: scan the blocks with scan_linen, else with nn.scan."""

  adapter: bool
  n_layers: int = L

  @nn.compact
  def __call__(self, x):
    scan = scan_linen if self.adapter else nn.scan
    blocks = scan(LinenBlock, variable_axes={"params": 0},
                  split_rngs={"params": True}, length=self.n_layers)
    h, _ = blocks(D, name="blocks")(x, None)
    return nn.Dense(OUT)(h)


def _mse(out, batch):
  return jnp.mean((out - batch["y"]) ** 2)


# Cached: engine.init and train_reference copy the params, never donate them.
@functools.cache
def nnx_setup(adapter=True):
  model = NNXModel(adapter, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  loss_fn = lambda p, b: _mse(nnx.merge(graphdef, p)(b["x"]), b)
  return loss_fn, params


@functools.cache
def linen_setup(adapter=True):
  model = LinenModel(adapter)
  params = model.init(jax.random.PRNGKey(0), jnp.ones((2, D)))["params"]
  loss_fn = lambda p, b: _mse(model.apply({"params": p}, b["x"]), b)
  return loss_fn, params


SETUPS = {"nnx": nnx_setup, "linen": linen_setup}


def batches(steps=5, batch=16, seed=0):
  rng = np.random.default_rng(seed)
  return [{"x": rng.normal(size=(batch, D)).astype(np.float32),
           "y": rng.normal(size=(batch, OUT)).astype(np.float32)}
          for _ in range(steps)]


def _engine(loss_fn, stage, **kw):
  return zj.Engine(loss_fn, optax.adamw(1e-3),
                   zj.ZeroConfig(stage=stage, min_shard_elements=0, **kw),
                   zj.make_mesh(num_devices=N))


def _close(a, b):
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5,
                                 atol=1e-6), a, b)


# ------------------------------------------------------ outside an engine


def test_scan_nnx_matches_nnx_scan_and_an_unrolled_loop():
  x = jnp.asarray(batches(1)[0]["x"])
  model, ref = NNXModel(True, rngs=nnx.Rngs(0)), NNXModel(False,
                                                          rngs=nnx.Rngs(0))
  _close(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param))
  want = ref(x)
  _close(model(x), want)
  # By hand: layer i is the i-th slice of every stacked Variable.
  graphdef, state = nnx.split(model.blocks)
  h = x
  for i in range(L):
    h = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))(h)
  _close(model.head(h), want)
  for remat in ("none", "dots_saveable"):  # model(x) used "full"
    _close(model.head(scan_nnx(model.blocks, x, remat=remat)), want)


def test_scan_nnx_carries_rng_state_like_nnx_scan():
  # Dropout keeps per-layer rng keys and counts: each layer draws from its
  # own stream, and the advanced counts are written back.
  x = jnp.asarray(batches(1)[0]["x"])
  make = lambda adapter: NNXModel(adapter, dropout=0.5,
                                  rngs=nnx.Rngs(params=0, dropout=1))
  model, ref = make(True), make(False)
  for _ in range(2):  # the second call must use the advanced counts
    _close(model(x), ref(x))
  counts = nnx.state(model.blocks, nnx.RngCount)
  _close(counts, nnx.state(ref.blocks, nnx.RngCount))
  assert all(np.all(np.asarray(c) == 2) for c in jax.tree.leaves(counts))
  nnx.reseed(model, dropout=7, policy="match_shape")
  nnx.reseed(ref, dropout=7, policy="match_shape")
  _close(model(x), ref(x))


def test_scan_nnx_rejects_a_module_that_is_not_stacked():
  block = NNXBlock(D, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="stacked module"):
    scan_nnx(block, jnp.ones((2, D)))


def test_scan_linen_is_nn_scan_at_init_and_in_forward():
  x = jnp.asarray(batches(1)[0]["x"])
  ours, theirs = LinenModel(True), LinenModel(False)
  p = ours.init(jax.random.PRNGKey(3), x)
  p_ref = theirs.init(jax.random.PRNGKey(3), x)
  # Same tree, stacked shapes and initial values: checkpoints interchange.
  assert jax.tree.structure(p) == jax.tree.structure(p_ref)
  jax.tree.map(np.testing.assert_array_equal, p, p_ref)
  assert p["params"]["blocks"]["Dense_0"]["kernel"].shape == (L, D, 2 * D)
  _close(ours.apply(p_ref, x), theirs.apply(p_ref, x))


class _XsBlock(nn.Module):
  """Takes a per-layer input and a broadcast one, returns a per-layer y."""

  @nn.compact
  def __call__(self, h, x_layer, scale, train):
    h = jnp.tanh(nn.Dense(h.shape[-1])(h) * scale + x_layer)
    h = nn.Dropout(0.5, deterministic=not train)(h)
    return h, jnp.sum(h, axis=-1)


def test_scan_linen_in_axes_ys_and_dropout_like_nn_scan():
  kw = dict(variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True}, length=L,
            in_axes=(0, nn.broadcast, nn.broadcast))
  ours, theirs = scan_linen(_XsBlock, **kw)(), nn.scan(_XsBlock, **kw)()
  h = jnp.ones((2, 8))
  xs, scale = jnp.arange(L * 8.0).reshape(L, 1, 8) / 10, jnp.float32(0.5)
  p = theirs.init(jax.random.PRNGKey(0), h, xs, scale, False)
  want = theirs.apply(p, h, xs, scale, False)
  assert want[1].shape == (L, 2)
  _close(ours.apply(p, h, xs, scale, False), want)
  # Dropout: a key per layer, fixed by the caller's key (masks differ from
  # nn.scan's, whose keys are derived differently).
  run = lambda k: ours.apply(p, h, xs, scale, True,
                             rngs={"dropout": jax.random.PRNGKey(k)})[0]
  _close(run(1), run(1))
  assert not np.allclose(run(1), run(2))
  with pytest.raises(NotImplementedError, match="variable_axes"):
    scan_linen(_XsBlock, variable_axes={"params": 0, "batch_stats": 0},
               length=L)


@pytest.mark.parametrize("framework", sorted(SETUPS))
def test_the_arrays_given_to_loss_fn_reach_scan_layers(framework,
                                                       monkeypatch):
  # The engine finds a layer's parameters by the identity of the arrays it
  # handed to loss_fn; if merge/split/apply copied them, every stage would
  # silently fall back to whole-model gathering.
  seen = []

  def spy(f, init, xs, **kw):
    seen.extend(id(x) for x in jax.tree.leaves(xs))
    return zj.scan_layers(f, init, xs, **kw)

  monkeypatch.setattr(flax_layers, "scan_layers", spy)
  loss_fn, params = SETUPS[framework]()
  given = []

  def traced(p, b):
    given.extend(id(x) for x in jax.tree.leaves(p["blocks"]))
    return loss_fn(p, b)

  jax.grad(traced)(params, batches(1)[0])
  assert len(given) == 6 and set(given) <= set(seen)


# ------------------------------------------------------------ in an engine


def test_scan_nnx_dropout_under_the_engine_follows_the_documented_recipe():
  model = NNXModel(True, dropout=0.5, rngs=nnx.Rngs(params=0, dropout=1))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(p, b, key):
    model = nnx.merge(graphdef, p, rest, copy=True)
    nnx.reseed(model, dropout=key, policy="match_shape")
    return _mse(model(b["x"]), b)

  engine = zj.Engine(loss_fn, optax.sgd(0.0),
                     zj.ZeroConfig(stage=3, min_shard_elements=0),
                     zj.make_mesh(num_devices=N), with_rng=True)
  state, b = engine.init(params), batches(1)[0]
  losses = []
  for _ in range(2):
    state, metrics = engine.step(state, b)
    losses.append(float(metrics["loss"]))
  # Unchanged params (lr 0), same batch: only the masks differ per step.
  assert np.all(np.isfinite(losses)) and losses[0] != losses[1]


@functools.cache
def _reference(framework):
  loss_fn, params = SETUPS[framework]()
  return m.train_reference(loss_fn, optax.adamw(1e-3), params, batches())


# The NNX model's stage-3 run without prefetch ("auto" prefetches a scan at
# stage 3: the Linen model's run is prefetched): its compiled step is the
# one whose collectives test_stage3_gathers_each_layer_inside_the_scan
# counts. (At stage 2 "auto" never prefetches.)
_PREFETCH = {("nnx", 3): False}


@functools.cache
def _trained(framework, stage):
  """``(engine, final state, losses, gathered params)``, once per file."""
  loss_fn, params = SETUPS[framework]()
  engine = _engine(loss_fn, stage,
                   prefetch=_PREFETCH.get((framework, stage), "auto"))
  losses, got, state = m.train_engine(engine, params, batches())
  return engine, state, losses, got


# Every stage with NNX; Linen from stage 2, where the adapter's layers are
# gathered and scattered one by one. (Below stage 2 the scan sees whole
# parameters: the adapters' forward is nn.scan's, checked above; Linen at
# stages 0 and 1 with -m exhaustive.)
@pytest.mark.parametrize("framework,stage", [
    ("nnx", 0), ("nnx", 1), ("nnx", 2), ("nnx", 3), ("linen", 2),
    ("linen", 3),
    pytest.param("linen", 0, marks=pytest.mark.exhaustive),
    pytest.param("linen", 1, marks=pytest.mark.exhaustive)])
def test_every_stage_matches_single_device_optax(framework, stage):
  _, _, losses, got = _trained(framework, stage)
  m.assert_matches(losses, got, *_reference(framework), tol=1e-5)


def _collectives(framework, adapter, stage):
  loss_fn, params = SETUPS[framework](adapter)
  # (The scan without prefetch: its gathers at the top of each iteration;
  # tests/layers/test_prefetch.py counts the prefetched scan's. The
  # per-device step's own collectives: a global loss leaves them to the
  # compiler, which on CPUs all-reduces what it reduce-scatters on GPUs.)
  engine = _engine(loss_fn, stage, prefetch=False, loss_scope="per_device")
  state = engine.init(params)
  compiled = engine.step.lower(state, batches(1)[0]).compile()
  size = lambda t: sum(math.prod(x.shape) for x in jax.tree.leaves(t))
  # min_shard_elements=0: every block leaf is sharded (only the head's bias
  # is replicated).
  assert not [p for p in engine.replicated_params() if "blocks" in p]
  return analysis.collectives(compiled.as_text()), size(params["blocks"]), size(
      params)


def _per_step_elements(ops, kind, in_loop):
  return sum(c.elements * c.executions for c in ops
             if c.kind == kind and (c.executions > 1) == in_loop)


@pytest.mark.parametrize("adapter", [True, False],
                         ids=["adapter", "plain_scan"])
@pytest.mark.parametrize("framework", sorted(SETUPS))
def test_stage3_gathers_each_layer_inside_the_scan(framework, adapter):
  ops, stacked, total = _collectives(framework, adapter, 3)
  looped = _per_step_elements(ops, "all-gather", True)
  outside = _per_step_elements(ops, "all-gather", False)
  if adapter:
    # Every stacked leaf is gathered one layer slice per iteration, in
    # forward and again in (rematerialized) backward where backward needs
    # it (XLA drops re-gathers of biases, whose gradient needs no value);
    # outside the loop only the other leaves are gathered. Gradients are
    # reduce-scattered per layer too.
    assert all(c.executions == L for c in ops
               if c.kind == "all-gather" and c.executions > 1)
    assert stacked < looped <= 2 * stacked, (looped, stacked)
    assert outside <= total - stacked, (outside, total, stacked)
    assert _per_step_elements(ops, "reduce-scatter", True) == stacked // N
  else:
    # Negative control: nnx.scan / nn.scan over the params loss_fn got
    # gathers each whole stack once, where loss_fn starts.
    assert looped == 0
    assert outside >= stacked
    assert _per_step_elements(ops, "reduce-scatter", True) == 0


@pytest.mark.parametrize("framework,adapter", [
    ("linen", True), ("nnx", True), ("linen", False)])
def test_stage2_scatters_each_layers_gradient_inside_the_scan(framework,
                                                              adapter):
  ops, stacked, _ = _collectives(framework, adapter, 2)
  looped = _per_step_elements(ops, "reduce-scatter", True)
  # Plain nn.scan: each whole (L, ...) gradient is scattered after backward.
  assert looped == (stacked // N if adapter else 0)
