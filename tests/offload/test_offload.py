"""Offload to host memory: every option places every state leaf where it
says, and trains bit-identically to the same run without offload.

On CPU the memory kinds exist and the code path runs, but nothing moves;
GPU figures come from ``experiments/gpu_bench.py``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from tests import _models as m
from tests._jaxpr import copies_to, layer_loops
from zero_jax import offload
from zero_jax.offload import _separable as separable

HOST, DEVICE = "pinned_host", "device"


# (A mask is a function of the parameter tree: init and update must see the
# tree, not a flat list.)
_OPTIMIZERS = dict(
    m.OPTIMIZERS, adam=lambda: optax.adam(1e-2),
    masked_adamw=lambda: optax.adamw(1e-2, weight_decay=0.1,
                                     mask=lambda p: {k: k != "b1" for k in p}))


def _master_on_host(stage, compute_dtype, offload_optimizer, offload_params):
  """The documented rule: the fp32 master goes to the host wherever forward
  reads a separate compute copy, or with offload_params."""
  return bool(offload_params or (offload_optimizer and compute_dtype
                                 and stage > 0))


def _train(model, opt="adamw", steps=3, **config):
  """``(losses, params, final state, engine)`` of ``steps`` steps of
  ``model`` ("mlp" or "gpt") on 8 devices. ``params``: the final state's
  float32 master as it is laid out (numpy reads it whole, with no gather
  program to compile)."""
  if model == "mlp":
    loss_fn, params, batches = m.mlp_loss, m.mlp_params(), m.mlp_batches(
        steps)
  else:
    loss_fn, params, batches = m.gpt_setup(steps=steps)
  engine = zj.Engine(loss_fn, _OPTIMIZERS[opt](),
                     zj.ZeroConfig(min_shard_elements=0, **config),
                     zj.make_mesh(num_devices=8))
  state, losses = m.run_steps(engine, engine.init(params), batches)
  return losses, state.params, state, engine


def _plain(model, opt="adamw", steps=3, **config):
  """The same run without offload, shared by the tests that need it (the
  cases here, the streamed update's and the GPT's references)."""
  return _plain_run(model, opt, steps, tuple(sorted(
      (k, v) for k, v in config.items() if v is not None)))


@functools.cache
def _plain_run(model, opt, steps, config):
  return _train(model, opt, steps, **dict(config))


def _check_placement(state, stage, compute_dtype=None, offload_optimizer=None,
                     offload_params=None, update_on="device", **_):
  kind = lambda on_host: HOST if on_host else DEVICE
  if update_on == "host":
    # Master and optimizer state on the host's CPU devices; the compute copy
    # where forward reads it.
    for x in jax.tree.leaves((state.params, state.opt_state)):
      assert x.sharding.mesh.axis_names == ("host",)
    for x in jax.tree.leaves(state.compute_params):
      assert x.sharding.memory_kind == kind(offload_params)
    return
  want = kind(offload_optimizer)
  for path, x in jax.tree_util.tree_leaves_with_path(state.opt_state):
    assert x.sharding.memory_kind == want, ("opt_state",
                                            jax.tree_util.keystr(path))
  want = kind(_master_on_host(stage, compute_dtype, offload_optimizer,
                              offload_params))
  for path, x in jax.tree_util.tree_leaves_with_path(state.params):
    assert x.sharding.memory_kind == want, ("params",
                                            jax.tree_util.keystr(path))
  for x in jax.tree.leaves(state.compute_params):
    assert x.sharding.memory_kind == DEVICE


def _assert_identical(run, ref):
  assert run[0] == ref[0]  # losses, bit for bit
  for x, y in zip(jax.tree.leaves(run[1]), jax.tree.leaves(ref[1])):
    np.testing.assert_array_equal(x, y)


CASES = (
    # (More streamed-update cases, with slices that cut: _STREAM_CASES.)
    [dict(stage=s, compute_dtype=cd, offload_optimizer="host",
          update_on="device")
     for s, cd in ((0, None), (1, None), (2, "bfloat16"), (3, None),
                   (3, "bfloat16"))] +
    [dict(stage=s, compute_dtype=cd, offload_optimizer="host",
          update_on="host")
     for s in (1, 3) for cd in (None, "bfloat16")] +
    # (With the update on the host, offload_optimizer changes nothing.)
    [dict(stage=3, compute_dtype=cd, offload_params="host", update_on=u,
          offload_optimizer=o)
     for cd in (None, "bfloat16") for u in ("device", "host")
     for o in ((None, "host") if u == "device" else ("host",))] +
    [dict(stage=2, compute_dtype="float16", offload_optimizer="host",
          update_on="host")])
# The default run: every pair of values of any two of stage, compute_dtype,
# update_on, offload_params and offload_optimizer that CASES holds; the
# other cases with -m exhaustive.
_PAIRWISE = (0, 1, 2, 3, 6, 9, 11, 12, 15)


@pytest.mark.parametrize(
    "config", [c if i in _PAIRWISE else
               pytest.param(c, marks=pytest.mark.exhaustive)
               for i, c in enumerate(CASES)],
    ids=["-".join(f"{k}={v}" for k, v in c.items() if v is not None)
         for c in CASES])
def test_offload_places_state_and_changes_nothing_else(config):
  run = _train("mlp", **config)
  _check_placement(run[2], **config)
  plain = {k: v for k, v in config.items()
           if k not in ("offload_optimizer", "offload_params", "update_on")}
  _assert_identical(run, _plain("mlp", **plain))


@pytest.mark.parametrize("config", [
    dict(offload_params="host"),
    dict(offload_params="host", compute_dtype="bfloat16"),
    dict(offload_optimizer="host", compute_dtype="bfloat16"),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_offloaded_stage3_gpt_gathers_layer_by_layer(config):
  # The GPT's layers run through scan_layers: with the master on the host,
  # each layer's shards are copied to the device inside the layer loop.
  run = _train("gpt", stage=3, **config)
  _check_placement(run[2], 3, **config)
  plain = {k: v for k, v in config.items() if k == "compute_dtype"}
  ref = _plain("gpt", stage=3, **plain)
  if not plain:
    _assert_identical(run, ref)
  else:
    # The plain step stores each layer's gradient shard, once summed in
    # fp32, rounded to bf16 (zero_jax.layers' stored_dtype); offload's go
    # to the host in fp32 as summed. Otherwise the same step: the first
    # loss (before any update) is identical, the rest agree to that
    # rounding, which Adam (lr 1e-2) turns into at most a few 1e-3 where a
    # gradient is near zero.
    assert run[0][0] == ref[0][0]
    np.testing.assert_allclose(run[0], ref[0], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(run[1]), jax.tree.leaves(ref[1])):
      diff = np.abs(np.asarray(x) - np.asarray(y))
      assert diff.max() <= 1e-2 and np.mean(diff > 1e-3) <= 0.01

  # The step the run compiled, traced again on its last state.
  _, _, state, engine = run
  batch = m.gpt_setup(steps=1)[2][0]
  # (Traced, not make_jaxpr'd: the step is a top-level jit with
  # compiler_options, which a jit nested by make_jaxpr may not carry.)
  jaxpr = engine.step.jitted.trace(state, engine.shard_batch(batch)).jaxpr
  scans = layer_loops(jaxpr.jaxpr)
  assert scans, "the GPT's layers are not scanned"
  copies = sum(copies_to(body, "Device") for body in scans)
  if config.get("offload_params"):
    assert copies > 0  # per-layer host-to-device copies inside the loop
  else:
    assert copies == 0  # the compute copy is already on the device


def test_offload_params_needs_stage_3():
  with pytest.raises(ValueError, match="needs stage=3"):
    zj.ZeroConfig(stage=2, offload_params="host")
  with pytest.raises(ValueError, match="set offload_optimizer='host'"):
    zj.ZeroConfig(update_on="host")
  with pytest.raises(ValueError, match="disk"):
    zj.ZeroConfig(offload_optimizer="nvme")


# The streamed update (zero_jax.offload.Streamer) with slices small enough that these
# small models are cut: several rows of a leaf per slice, several scans.
_STREAM_CASES = [
    ("adamw", dict(stage=3)),
    ("adam", dict(stage=1)),
    ("masked_adamw", dict(stage=3, compute_dtype="bfloat16")),
    ("masked_adamw", dict(stage=3, compute_dtype="bfloat16",
                          loss_scope="per_device")),
    ("adamw", dict(stage=1, compute_dtype="bfloat16")),
    ("adamw", dict(stage=2, compute_dtype="float16")),
    ("adamw", dict(stage=0)),
    ("sgd_momentum", dict(stage=3, compute_dtype="bfloat16",
                          offload_params="host")),
    ("lion", dict(stage=3, offload_params="host")),
    # Gradients in host memory (stage 3): clipped and unscaled slice by
    # slice as the update reads them.
    ("adamw", dict(stage=3, compute_dtype="float16", offload_params="host",
                   clip_grad_norm=0.05)),
    ("adamw", dict(stage=3, clip_grad_norm=0.05, offload_params="host")),
    ("adafactor", dict(stage=3, compute_dtype="bfloat16")),
]


@pytest.mark.parametrize("opt,config", _STREAM_CASES,
                         ids=lambda c: c if isinstance(c, str) else "-".join(
                             f"{k}={v}" for k, v in c.items()))
def test_streamed_update_equals_the_update_without_offload(opt, config,
                                                           monkeypatch):
  monkeypatch.setattr("zero_jax.offload._stream.SLICE_BYTES", 1024)
  # fp32: three steps. 16-bit compute: one step, because a last-bit
  # difference in the fp32 master (XLA fuses a slice's update differently
  # from the whole leaf's) can flip a 16-bit rounding in the next forward.
  steps = 3 if "compute_dtype" not in config else 1
  _, _, state, engine = _train("mlp", opt, steps, offload_optimizer="host",
                               **config)
  # (Without offload the slices are never used: a shared plain run.)
  ref = (_plain if "offload_params" not in config else _train)(
      "mlp", opt, steps, **config)[2]
  calls = engine.layout.update.streamer.calls
  assert engine.placement.grads_on_host == (
      config["stage"] == 3 and
      ("compute_dtype" in config or "offload_params" in config))
  if opt == "adafactor":
    # Its per-leaf RMS clipping mixes rows: every leaf is updated whole.
    assert all(k == 1 for k, _ in calls)
  else:
    assert sum(k > 1 for k, _ in calls) >= 2, calls  # several scans
  for tree, ref_tree in ((state.params, ref.params),
                         (state.opt_state, ref.opt_state)):
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(ref_tree)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0,
                                 atol=1e-6)
  # Adam's count (shared by every slice) advanced once per step.
  counts = [x for x in jax.tree.leaves(state.opt_state)
            if np.asarray(x).dtype == np.int32]
  assert all(int(c) == steps for c in counts)


@pytest.mark.parametrize("opt,config", [
    ("clip_adam", dict(stage=3, compute_dtype="bfloat16")),
    ("adamw", dict(stage=2, compute_dtype="float16", clip_grad_norm=0.05)),
    ("adafactor", dict(stage=3, offload_params="host")),
], ids=lambda c: c if isinstance(c, str) else "-".join(
    f"{k}={v}" for k, v in c.items()))
def test_host_update_runs_on_the_spare_cpu_devices_and_changes_nothing(
    opt, config):
  # The mesh takes 4 of the 8 CPU devices; the update runs on the other 4,
  # as it runs on the CPU beside a GPU: two programs on disjoint devices.
  # Any chain is exact there, a global norm inside tx included.
  def run(**extra):
    engine = zj.Engine(m.mlp_loss, m.OPTIMIZERS[opt](),
                       zj.ZeroConfig(min_shard_elements=0, **config, **extra),
                       zj.make_mesh(num_devices=4))
    state = engine.init(m.mlp_params())
    losses = []
    for batch in m.mlp_batches(3):
      state, metrics = engine.step(state, batch)
      losses.append(float(metrics["loss"]))
    return engine, state, losses

  engine, state, losses = run(offload_optimizer="host", update_on="host")
  _, ref, ref_losses = run()
  used = set(engine.mesh.devices.flat)
  for x in jax.tree.leaves((state.params, state.opt_state)):
    assert len(x.sharding.device_set) == 4
    assert x.sharding.device_set.isdisjoint(used)
  assert "host update over 4 CPU device(s)" in engine.describe()
  # (A global norm sums in another order over another layout: last bits.)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  # With float16 compute and clipping, such a last bit of the clipped
  # master can round one element of the float16 compute copy the other
  # way, which moves the next gradients by a float16 ulp (measured: 1.8e-5
  # at most after 3 steps; 0 without clipping, 9e-8 in float32). A wrong
  # update (a skipped step, unclipped or scaled gradients) moves them by
  # the learning rate, 1e-2.
  atol = 5e-5 if config.get("compute_dtype") == "float16" else 1e-6
  for x, y in zip(jax.tree.leaves((state.params, state.opt_state)),
                  jax.tree.leaves((ref.params, ref.opt_state))):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0,
                               atol=atol)


@pytest.mark.parametrize("stage,accum", [(1, 1), (1, 2), (2, 1), (2, 2),
                                         (3, 1)])
def test_host_update_takes_16_bit_gradients_in_the_reduce_dtype(stage,
                                                                 accum):
  # ZeRO-Offload's traffic: with a 16-bit reduce_dtype the gradients cross
  # to the host in it. With one micro-batch that rounds nothing the update
  # on the device would not (one reduction's sums; stage 3 sends each shard
  # to host memory as backward makes it), so training is the device's,
  # exactly; over several, their float32 sum is rounded to bfloat16 once
  # (2 bytes a parameter at every stage and with accumulation): each
  # update then moves by at most lr * 2**-8 more than the device's.
  def run(**extra):
    engine = zj.Engine(m.mlp_loss, m.OPTIMIZERS["adamw"](), zj.ZeroConfig(
        stage=stage, min_shard_elements=0, compute_dtype="bfloat16",
        reduce_dtype="bfloat16", grad_accum_steps=accum, **extra),
                       zj.make_mesh(num_devices=4))
    state = engine.init(m.mlp_params())
    batches = m.mlp_batches(3)
    lowered = engine.step.lower(state, engine.shard_batch(batches[0]))
    losses = []
    for batch in batches:
      state, metrics = engine.step(state, batch)
      losses.append(float(metrics["loss"]))
    return engine, lowered, state, losses

  engine, lowered, state, losses = run(offload_optimizer="host",
                                       update_on="host")
  _, _, ref, ref_losses = run()
  assert "gradients go to the host in bfloat16" in engine.describe()
  # The device's program returns the gradients: the 64 x 64 and 16 x 64
  # weights' in bfloat16 (half the bytes), with several micro-batches too.
  grads = jax.tree.leaves(lowered.out_info[-1])
  dtypes = sorted(str(g.dtype) for g in grads if g.shape in ((16, 64),
                                                             (64, 64)))
  assert dtypes == ["bfloat16", "bfloat16"], dtypes
  # (3 updates at the optimizer's rate, 1e-2.)
  rtol, atol = (1e-6, 1e-6) if accum == 1 else (1e-4, 3 * 1e-2 * 2**-8)
  np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
  for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0,
                               atol=atol)
  if accum == 1:
    for x, y in zip(jax.tree.leaves(state.opt_state),
                    jax.tree.leaves(ref.opt_state)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0,
                                 atol=1e-6)


def test_delay_update_applies_each_gradient_one_update_late():
  tx = m.OPTIMIZERS["adamw"]()
  batches = m.mlp_batches(4)
  engine = zj.Engine(m.mlp_loss, tx, zj.ZeroConfig(
      stage=3, min_shard_elements=0, offload_optimizer="host",
      update_on="host", delay_update=True), zj.make_mesh(num_devices=4))
  state = engine.init(m.mlp_params())
  losses = []
  for batch in batches:
    state, metrics = engine.step(state, batch)
    losses.append(float(metrics["loss"]))
  assert "delay_update" in engine.describe()
  # Plain optax on one device, each gradient taken at the parameters from
  # before the previous update (DeepSpeed's delayed parameter update).
  # (Jitted: one compile each instead of one per operation.)
  grad = jax.jit(jax.value_and_grad(m.mlp_loss))

  @jax.jit
  def update(g, opt_state, p):
    updates, opt_state = tx.update(g, opt_state, p)
    return optax.apply_updates(p, updates), opt_state

  p = before = m.mlp_params()
  opt_state, ref = tx.init(p), []
  for batch in batches:
    loss, g = grad(before, batch)
    ref.append(float(loss))
    before, (p, opt_state) = p, update(g, opt_state, p)
  np.testing.assert_allclose(losses, ref, rtol=1e-6)
  out = engine.gather_params(state)
  for k in p:
    np.testing.assert_allclose(np.asarray(out[k]), np.asarray(p[k]), rtol=0,
                               atol=1e-6)
  with pytest.raises(ValueError, match="update_on='host'"):
    zj.ZeroConfig(offload_optimizer="host", delay_update=True)


def test_host_update_writes_the_copy_into_the_last_ones_buffers():
  # Every output of the host's update takes a donated input's buffers (a
  # fresh host buffer costs a page fault per 4 KiB on first write): the
  # master and moments their own, the compute copy the last copy's.
  shapes = {"w": jax.ShapeDtypeStruct((64, 8), np.float32),
            "b": jax.ShapeDtypeStruct((8,), np.float32)}
  host = offload.HostUpdate(optax.adamw(1e-2), shapes, jax.devices()[4:])
  w = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
  master = host.put({"w": w, "b": np.ones(8, np.float32)})
  opt = host.init(master)
  grads = {"w": np.full((64, 8), 0.5, np.float32),
           "b": np.full(8, -0.25, np.float32)}
  prepare = lambda g, extra: (g, None, None)
  update = functools.partial(host.update, prepare=prepare,
                             compute_dtype=jnp.bfloat16)
  ref_m, ref_o, ref_c, _ = update(grads, host.put(master), host.init(master),
                                  {})
  master, opt, copy, _ = update(grads, master, opt, {})
  assert host.fits(copy, jnp.bfloat16) and not host.fits(copy, jnp.float32)
  pointers = lambda t: [s.data.unsafe_buffer_pointer()
                        for x in jax.tree.leaves(t) for s in
                        x.addressable_shards]
  before = pointers((master, opt, copy))
  master, opt, again, _ = update(grads, master, opt, {}, into=copy)
  assert copy["w"].is_deleted() and not host.fits(copy, jnp.bfloat16)
  assert pointers((master, opt, again)) == before
  # The same values as an update into fresh buffers.
  ref_m, ref_o, ref_c, _ = update(grads, ref_m, ref_o, {})
  for x, y in zip(jax.tree.leaves((master, opt, again)),
                  jax.tree.leaves((ref_m, ref_o, ref_c))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_host_update_layout_warnings_and_limits(monkeypatch):
  host = offload.HostUpdate(
      optax.adam(1e-3), {"w": jax.ShapeDtypeStruct((6, 8), np.float32)},
      jax.devices()[:4])
  # The first axis each device can take a block of, else another; else
  # whole on each (and said so).
  spec = lambda shape: host.sharding(shape).spec
  assert spec((8, 6)) == P("host") and spec((6, 8)) == P(None, "host")
  assert spec((6, 3)) == P() and spec(()) == P()
  assert host.replicated_bytes([jnp.zeros((6, 3))]) == 72
  config = zj.ZeroConfig(offload_optimizer="host", update_on="host")
  # One CPU device (the default beside a GPU): a warning names the fix.
  monkeypatch.setattr("zero_jax.offload._host.host_devices",
                      lambda mesh: jax.devices()[:1])
  engine = zj.Engine(m.mlp_loss, optax.adam(1e-3), config,
                     zj.make_mesh(num_devices=8))
  with pytest.warns(UserWarning, match="jax_num_cpu_devices"):
    engine.init(m.mlp_params())


def test_host_update_mirrors_the_mesh_in_a_multi_process_run(monkeypatch):
  """The layout of tests/distributed/test_host_update_multiprocess.py's
  2-process run, built in one process that says it is one of two: each
  device's shards on the CPU devices the mesh leaves free, laid out as on
  the mesh and split among a power of two of them; too few free CPU
  devices is an error that names the fix."""
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  config = zj.ZeroConfig(stage=2, offload_optimizer="host", update_on="host",
                         min_shard_elements=0)
  # 4 free CPU devices for 4 devices: one each; 6 for 2: two each.
  for n, c in ((4, 1), (2, 2)):
    engine = zj.Engine(m.mlp_loss, optax.adam(1e-3), config,
                       zj.make_mesh(num_devices=n))
    state = engine.init(m.mlp_params())
    assert f"{c} per device of the mesh" in engine.describe()
    plan = engine.param_plan.shardings
    for name, x in state.params.items():
      host = x.sharding.mesh.devices
      assert host.shape == (n, c)
      assert list(host.flat) == jax.devices()[n:n + n * c]
      # The device's spec, each block split in two where c is 2.
      want = [("data", "host") if c == 2 and e == "data" else e
              for e in plan[name].spec]
      got = list(x.sharding.spec)
      assert got[:len(want)] == want and not any(got[len(want):]), (
          name, x.sharding.spec)
    # The master's shards, on their devices again (assembled from the
    # partners' blocks): the values init gave.
    back = engine.gather_params(state)
    for name, x in m.mlp_params().items():
      np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(x))
  with pytest.raises(ValueError, match="jax_num_cpu_devices"):
    zj.Engine(m.mlp_loss, optax.adam(1e-3), config,
              zj.make_mesh(num_devices=6)).init(m.mlp_params())


def test_streamed_update_refuses_a_global_norm_in_the_chain():
  engine = zj.Engine(m.mlp_loss, m.OPTIMIZERS["clip_adam"](),
                     zj.ZeroConfig(offload_optimizer="host"),
                     zj.make_mesh(num_devices=8))
  with pytest.raises(ValueError, match=r"ZeroConfig\(clip_grad_norm"):
    engine.init(m.mlp_params())
  # The same clipping through the config streams, and is exact.
  engine = zj.Engine(m.mlp_loss, m.OPTIMIZERS["adamw"](),
                     zj.ZeroConfig(offload_optimizer="host",
                                   clip_grad_norm=0.1),
                     zj.make_mesh(num_devices=8))
  engine.init(m.mlp_params())


def test_separable_tells_rows_and_leaves_apart():
  x = jax.ShapeDtypeStruct((4, 3), np.float32)
  tag = separable.Tag
  # Elementwise and reductions over other axes keep rows apart; a cumulative
  # sum down the rows, or a sum over them, mixes them.
  r = separable.analyze(
      lambda a, b, c: (a * 2 + a.sum(1, keepdims=True), jnp.cumsum(b, 0),
                       c.T.sum(1)),
      (x, x, x), (tag({0: 0}), tag({1: 0}), tag({2: 0})))
  assert r.lost == {1, 2} and not r.cross
  assert r.out == [{0: 0}, {1: None}, {2: None}]
  # A global norm meets both leaves in one value.
  r = separable.analyze(lambda a, b: a / (jnp.sum(a * a) + jnp.sum(b * b)),
                        (x, x), (tag({0: 0}), tag({1: 0})))
  assert r.cross and r.cross[0][1] == {0, 1}
