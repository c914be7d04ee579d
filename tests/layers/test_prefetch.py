"""``ZeroConfig.prefetch``: scanned layers gathered one layer ahead
(``zero_jax.layers._prefetch``), each layer's parameters as one collective.

Exactness against single-device optax and against the step without
prefetch; a scan with integer and closed-over inputs; the errors that
refuse what it cannot honour; and, compiled for 8 H100s, that each layer
is gathered once per direction, beside the previous layer's gemms.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from tests import _models as m
from tests._gpu import compiles_for_gpus


def _engine(loss_fn, prefetch, replica=1, **kw):
  return zj.Engine(loss_fn, m.OPTIMIZERS["adamw"](m.LR_SCALE["gpt"]),
                   zj.ZeroConfig(stage=3, prefetch=prefetch, **kw),
                   zj.make_mesh(num_devices=8, replica=replica))


@pytest.mark.parametrize("replica", [1, 2])
def test_prefetched_gpt_trains_as_single_device_optax(replica):
  # (With replica groups the combined reduction also sums across them.)
  loss_fn, params, batches = m.MODELS["gpt"]()
  ref_losses, ref_params = m.cached_reference("gpt", "adamw")
  losses, params_out, _ = m.train_engine(
      _engine(loss_fn, True, replica), params, batches)
  m.assert_matches(losses, params_out, ref_losses, ref_params)


@pytest.mark.parametrize("kw", [
    # Both at once by default; each alone with -m exhaustive.
    {"compute_dtype": "bfloat16", "quantized_weights": True},
    pytest.param({"compute_dtype": "bfloat16"},
                 marks=pytest.mark.exhaustive),
    pytest.param({"quantized_weights": True}, marks=pytest.mark.exhaustive),
], ids=lambda kw: "-".join(kw))
def test_prefetch_changes_no_sum(kw):
  # Mixed precision and qwZ are approximate against fp32 optax; prefetch
  # itself adds nothing: the same values summed in the same order.
  loss_fn, params, batches = m.MODELS["gpt"](steps=4)
  runs = [m.train_engine(_engine(loss_fn, p, **kw), params, batches)
          for p in (False, True)]
  (l0, p0, _), (l1, p1, _) = runs
  np.testing.assert_array_equal(l0, l1)
  for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                               atol=1e-6)


def _scan_model():
  """Stacked layers scanned with an integer per-layer input and a shared
  scale read from the closure (both outside the gathered parameters)."""
  layers, d = 3, 64
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(layers, d, d)) / 8,
                             jnp.float32),
            "scale": jnp.ones((d,), jnp.float32)}

  def loss_fn(p, batch):
    def layer(h, xs):
      w, i = xs
      h = jnp.tanh(h @ w) * p["scale"] + 0.01 * i.astype(h.dtype)
      return h, jnp.mean(h)

    h, ys = zj.scan_layers(layer, batch["x"],
                           (p["w"], jnp.arange(layers, dtype=jnp.int32)))
    # (Means over the batch: the engine averages the devices' losses.)
    return jnp.mean(h ** 2) + 1e-2 * jnp.sum(ys)

  batches = [{"x": jnp.asarray(rng.normal(size=(16, d)), jnp.float32)}
             for _ in range(3)]
  return loss_fn, params, batches


def test_integer_inputs_and_closed_over_parameters_get_their_gradients():
  loss_fn, params, batches = _scan_model()
  # Single-device optax on the same global batches (SGD: Adam's first
  # steps would magnify float32 rounding in the tiniest gradients).
  tx = optax.sgd(0.5)

  @jax.jit
  def step(p, opt, b):
    u, opt = tx.update(jax.grad(loss_fn)(p, b), opt, p)
    return optax.apply_updates(p, u), opt

  ref, opt = params, tx.init(params)
  for b in batches:
    ref, opt = step(ref, opt, b)
  engine = zj.Engine(loss_fn, optax.sgd(0.5),
                     zj.ZeroConfig(stage=3, prefetch=True,
                                   min_shard_elements=0),
                     zj.make_mesh(num_devices=8))
  state = engine.init(params)
  for b in batches:
    state, _ = engine.step(state, b)
  out = engine.gather_params(state)
  # The shared scale moved: its gradient came back through the closure.
  assert not np.allclose(np.asarray(out["scale"]), 1.0)
  for k in ref:
    np.testing.assert_allclose(np.asarray(out[k]), np.asarray(ref[k]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw,match", [
    ({"stage": 2}, "stage=2"),
    ({"remat": "dots_saveable"}, "remat=.*dots_saveable"),
    ({"partition_activations": True}, "partition_activations=True"),
    ({"offload_params": "host"}, "offload_params='host'"),
])
def test_configs_prefetch_cannot_honour_are_refused(kw, match):
  with pytest.raises(ValueError, match=match):
    zj.ZeroConfig(**{"stage": 3, "prefetch": True, **kw})


def test_a_scan_asking_for_another_remat_is_refused():
  loss_fn, params, batches = m.MODELS["gpt"](steps=1)

  def other_remat(p, b):
    def layer(h, w):
      return jnp.tanh(h @ w), None
    h, _ = zj.scan_layers(layer, b["x"], p["w"], remat="dots_saveable")
    return jnp.sum(h)

  params = {"w": jnp.ones((2, 64, 64), jnp.float32)}
  engine = zj.Engine(other_remat, optax.sgd(0.1),
                     zj.ZeroConfig(stage=3, prefetch=True,
                                   min_shard_elements=0),
                     zj.make_mesh(num_devices=8))
  state = engine.init(params)
  with pytest.raises(ValueError, match="another remat"):
    engine.step(state, {"x": jnp.ones((8, 64), jnp.float32)})


@pytest.mark.parametrize("kw,on", [
    ({}, True),
    ({"stage": 2}, False),
    ({"remat": "dots_saveable"}, False),
    ({"offload_optimizer": "host", "compute_dtype": "bfloat16"}, False),
])
def test_auto_prefetches_where_the_layout_allows_and_says_which(kw, on):
  loss_fn, params, _ = m.MODELS["gpt"](steps=1)
  engine = zj.Engine(loss_fn, optax.sgd(0.1),
                     zj.ZeroConfig(**{"stage": 3, **kw}),
                     zj.make_mesh(num_devices=8))
  engine.init(params)
  said = [line for line in engine.describe().splitlines()
          if line.startswith("prefetch (auto)")]
  assert len(said) == 1
  assert ("off" not in said[0]) is on, said


def test_auto_runs_a_scan_asking_for_another_remat_without_prefetch():
  # Asked for, prefetch refuses this scan (above); "auto" runs it plain,
  # with the same result as prefetch=False.
  def other_remat(p, b):
    def layer(h, w):
      return jnp.tanh(h @ w), None
    h, _ = zj.scan_layers(layer, b["x"], p["w"], remat="dots_saveable")
    return jnp.mean(h ** 2)

  params = {"w": jnp.full((2, 64, 64), 0.05, jnp.float32)}
  batch = {"x": jnp.ones((8, 64), jnp.float32)}
  out = []
  for prefetch in ("auto", False):
    engine = zj.Engine(other_remat, optax.sgd(0.1),
                       zj.ZeroConfig(stage=3, prefetch=prefetch,
                                     min_shard_elements=0),
                       zj.make_mesh(num_devices=8))
    state, _ = engine.step(engine.init(params), batch)
    out.append(np.asarray(engine.gather_params(state)["w"]))
  np.testing.assert_array_equal(*out)
  assert not np.allclose(out[0], 0.05)


@pytest.mark.parametrize("prefetch", [False, True, "auto"])
def test_the_step_is_compiled_with_prefetchs_options(monkeypatch, prefetch):
  # An option XLA does not know fails the compile that is given it: only
  # the prefetching step is (at stage 3, remat full, "auto" prefetches),
  # with the options of its loss scope (the global loss's, by default).
  loss_fn, params, batches = _scan_model()
  for scope, options in (("global", "GLOBAL_PREFETCH_COMPILER_OPTIONS"),
                         ("per_device", "PREFETCH_COMPILER_OPTIONS")):
    with monkeypatch.context() as patch:
      patch.setattr(zj.layers, options,
                    {"xla_no_such_option_for_this_test": 1})
      engine = zj.Engine(loss_fn, optax.sgd(0.5),
                         zj.ZeroConfig(stage=3, prefetch=prefetch,
                                       min_shard_elements=0,
                                       loss_scope=scope),
                         zj.make_mesh(num_devices=8))
      state = engine.init(params)
      if prefetch:
        with pytest.raises(Exception,
                           match="xla_no_such_option_for_this_test"):
          engine.step(state, batches[0])
      else:
        engine.step(state, batches[0])


_TINY = dict(layers=4, hidden=128, heads=4, vocab=64, seq_len=16,
             micro_batch=2, attention="einsum")


@compiles_for_gpus
def test_each_layer_is_gathered_once_a_direction_beside_gemms():
  from zero_jax import analysis, models
  _, plain = models.compile_gpt("h100", 8, 3, **_TINY,
                                overrides={"prefetch": False})
  _, ahead = models.compile_gpt("h100", 8, 3, **_TINY,
                                overrides={"prefetch": True})
  loops = [a for a in analysis.overlap(ahead.hlo) if a.executions > 1]
  gathers = [a for a in loops if a.kind == "all-gather"]
  # One combined all-gather in the forward loop and one in the backward,
  # each run once per layer.
  assert [a.executions for a in gathers] == [_TINY["layers"]] * 2
  # Without prefetch, the layer's gathers wait at the top of the layer.
  plain_gathers = [a for a in analysis.overlap(plain.hlo)
                   if a.executions > 1 and a.kind == "all-gather"]
  assert plain_gathers and not any(a.overlapped for a in plain_gathers)
  # With it, the forward's runs beside the layer's gemms. (The backward's
  # shares XLA's one window for asynchronous collectives with the gradient
  # all-to-all: on jax 0.10 it overlaps at this shape, on 0.12 it waits
  # unless two collectives may be in flight; experiments/stage3_bench.py
  # measures both.)
  assert any(a.overlapped for a in gathers)
  assert (analysis.overlap_summary(ahead.hlo)["all-gather"].overlapped >
          analysis.overlap_summary(plain.hlo)["all-gather"].overlapped)
