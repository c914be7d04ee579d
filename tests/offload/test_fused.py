"""The fused host optimizer (update_on="host" with zero_jax.offload's
optimizers): its casts bit for bit, its updates against optax, its host
buffers through checkpoints, and the fallback it states."""

import os
import subprocess
import sys

import ml_dtypes
import jax
import numpy as np
import optax
import pytest

import zero_jax as zj
from tests import _models as m
from zero_jax import analysis, models, offload
from zero_jax.offload import _kernels, _loops
from zero_jax.offload._buffers import aligned

STEPS = 4
CLIP = 0.5


def _optimizers():
  decay_matrices = lambda p: jax.tree.map(lambda x: len(x.shape) > 1, p)
  inject = optax.inject_hyperparams
  # name -> (the fused optimizer, the same built by optax alone: the fused
  # ones are optax's under inject_hyperparams, whose hyperparameters are
  # float32 arrays, not Python floats, so the arithmetic differs in the
  # last bit otherwise)
  return {
      "adamw": (lambda: offload.adamw(1e-2, weight_decay=0.1,
                                      mask=decay_matrices),
                lambda: inject(optax.adamw, static_args="mask")(
                    1e-2, weight_decay=0.1, mask=decay_matrices)),
      "adam": (lambda: offload.adam(optax.linear_schedule(1e-2, 1e-3, 3)),
               lambda: inject(optax.adam)(
                   optax.linear_schedule(1e-2, 1e-3, 3))),
      "lion": (lambda: offload.lion(1e-3), lambda: inject(optax.lion)(1e-3)),
      "sgd_nesterov": (lambda: offload.sgd(1e-2, momentum=0.9, nesterov=True),
                       lambda: inject(optax.sgd)(1e-2, momentum=0.9,
                                                 nesterov=True)),
      "sgd": (lambda: offload.sgd(1e-2), lambda: inject(optax.sgd)(1e-2)),
      "adagrad": (lambda: offload.adagrad(1e-2),
                  lambda: inject(optax.adagrad)(1e-2)),
  }


def test_casts_and_widening_are_bit_exact():
  k = _kernels.kernels()
  bits = np.random.default_rng(0).integers(0, 2**32, 200_000, np.uint32)
  edges = np.array([0, -0.0, 1, 65504, 65519.9, 65520, 6.1e-5, 5.96e-8,
                    2.98e-8, 2.99e-8, 1e-9, np.inf, -np.inf, np.nan],
                   np.float32)
  x = np.concatenate([bits.view(np.float32), edges])
  for dtype in (np.float16, ml_dtypes.bfloat16):
    out = np.empty(x.size, dtype)
    k.cast(x, _kernels.as_kernel_array(out))
    with np.errstate(all="ignore"):
      want = x.astype(dtype)
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))
    finite = want[np.isfinite(want.astype(np.float32))]
    assert k.sumsq(_kernels.as_kernel_array(finite)) == pytest.approx(
        np.sum(finite.astype(np.float64) ** 2), rel=1e-12)
  assert not np.isfinite(k.sumsq(_kernels.as_kernel_array(
      np.array([1, np.nan], ml_dtypes.bfloat16))))


def _kernel_calls():
  k, f = _kernels.kernels(), np.float32
  one = (f(2), f(1.5), f(0.5))  # (unscale, clip)
  return {
      "adam": lambda p, g, s, t, out: k.adam(
          p, g, s, t, out, *one, f(-1e-2), f(0.9), f(0.999), f(1e-8), f(0),
          f(0.1), f(0.1), f(0.001), f(0.01)),
      "lion": lambda p, g, s, t, out: k.lion(
          p, g, s, out, *one, f(-1e-3), f(0.9), f(0.99), f(0.1), True),
      "sgd": lambda p, g, s, t, out: k.sgd(p, g, s, out, *one, f(-1e-2),
                                           f(0.9), True),
      "adagrad": lambda p, g, s, t, out: k.adagrad(p, g, s, out, *one,
                                                   f(-1e-2), f(1e-7)),
      "torch_sgd": lambda p, g, s, t, out: k.torch_sgd(
          p, g, s, out, *one, f(-1e-2), f(0.01), f(0.9), f(0.9), False,
          True),
      "torch_adagrad": lambda p, g, s, t, out: k.torch_adagrad(
          p, g, s, out, *one, f(-1e-2), f(0.01), f(1e-10), f(1.0)),
  }


@pytest.mark.parametrize("n", [1, _loops.BLOCK - 1, 3 * _loops.BLOCK + 5,
                               40_000])
def test_blocks_streamed_or_stored_write_the_same(n):
  """Every kernel over a leaf of ``n`` elements writes the same master,
  state and compute copy whether the copy streams past the cache a block
  at a time (an aligned buffer), is stored directly (a buffer off 32
  bytes, or every other element of one), is not written, or runs on one
  thread; the copy is the new master's cast."""
  k = _kernels.kernels()
  rng = np.random.default_rng(n)
  start = [rng.standard_normal(n).astype(np.float32) for _ in range(2)] + [
      np.abs(rng.standard_normal(n)).astype(np.float32) for _ in range(2)]
  for name, call in _kernel_calls().items():
    runs = []
    for where in ("aligned", "off", "strided", "none", "one thread"):
      p, g, s, t = (x.copy() for x in start)
      whole = aligned((2 * n,), ml_dtypes.bfloat16)
      whole[:] = 7
      out = (np.empty(n + 1, ml_dtypes.bfloat16)[1:] if where == "off"
             else whole[::2] if where == "strided"
             else aligned((n,), ml_dtypes.bfloat16))
      k.set_threads(1 if where == "one thread" else k.max_threads)
      try:
        call(p, g, s, t, _kernels.NOTHING if where == "none" else
             _kernels.as_kernel_array(out))
      finally:
        k.set_threads(k.max_threads)
      runs.append((p, s, t, None if where == "none" else out))
      assert np.all(whole[1::2] == 7), name  # (nothing written between)
      if runs[-1][3] is not None:
        np.testing.assert_array_equal(
            out.view(np.uint16), p.astype(ml_dtypes.bfloat16).view(np.uint16),
            err_msg=f"{name} {where}")
    changed = runs[0][0] != start[0]  # (every block, the short one too)
    assert all(changed[i:i + _loops.BLOCK].any()
               for i in range(0, n, _loops.BLOCK)), name
    for run in runs[1:]:
      for a, b in zip(runs[0], run):
        if b is not None:
          np.testing.assert_array_equal(a.view(np.uint16) if a.dtype.itemsize
                                        == 2 else a, b.view(np.uint16) if
                                        b.dtype.itemsize == 2 else b,
                                        err_msg=name)


def test_kernels_load_from_numba_cache_in_a_new_process(tmp_path):
  """A second process finds the compiled kernels in numba's cache (a
  kernel whose closure held numba's objects was never found again: every
  process compiled it afresh and added a file)."""
  code = ("import numpy as np\n"
          "from zero_jax.offload import _kernels\n"
          "k = _kernels.kernels()\n"
          "k.cast(np.ones(300, np.float32), np.empty(300, np.uint16))\n"
          "print(sum(k.update.stats.cache_hits.values()))")
  env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
  hits = [int(subprocess.run([sys.executable, "-c", code], env=env,
                             check=True, capture_output=True, text=True
                             ).stdout.split()[-1]) for _ in range(2)]
  assert hits == [0, 1]


def _engine(tx, stage, dtype="float32", accum=None):
  return zj.Engine(m.mlp_loss, tx, zj.ZeroConfig(
      stage=stage, offload_optimizer="host", update_on="host",
      clip_grad_norm=CLIP, compute_dtype=dtype, grad_accum_steps=accum,
      min_shard_elements=0), zj.make_mesh(num_devices=8))


# (optimizer, stage, compute dtype, micro-batches): every optimizer, every
# stage, each compute dtype, with and without accumulation. fp32 against
# single-device optax; 16-bit against the same engine with optax's own
# optimizer, whose update is the XLA:CPU program (the device's part, and so
# the gradients, are the same program).
CASES = [("adamw", 3, "float32", None), ("adagrad", 2, "float32", 2),
         ("adam", 0, "bfloat16", 2), ("lion", 1, "float16", None),
         ("sgd_nesterov", 2, "bfloat16", None), ("sgd", 3, "float16", 2),
         ("adamw", 1, "float16", 2), ("lion", 3, "bfloat16", 2)]


@pytest.mark.parametrize("name,stage,dtype,accum", CASES)
def test_fused_update_equals_optax(name, stage, dtype, accum):
  fused, plain = _optimizers()[name]
  params, batches = m.mlp_params(), m.mlp_batches(STEPS)
  engine = _engine(fused(), stage, dtype, accum)
  losses, out, state = m.train_engine(engine, params, batches)
  assert "numba) on" in engine.describe()
  assert isinstance(jax.tree.leaves(state.params)[0], np.ndarray)
  if dtype == "float32":
    tx = optax.chain(optax.clip_by_global_norm(CLIP), plain())
    ref_losses, ref = m.train_reference(m.mlp_loss, tx, params, batches)
    tol = 1e-6
  else:
    xla = _engine(plain(), stage, dtype, accum)
    ref_losses, ref, _ = m.train_engine(xla, params, batches)
    assert "XLA:CPU program" in xla.describe()
    tol = 1e-6
  m.assert_matches(losses, out, ref_losses, ref, tol=tol)
  if dtype == "float16":
    assert float(state.loss_scale.scale) == 2.0 ** 16  # (scaled, no skip)


def test_fused_state_checkpoints_and_old_states_are_refused(tmp_path):
  fused, _ = _optimizers()["adamw"]
  params, batches = m.mlp_params(), m.mlp_batches(STEPS)
  engine = _engine(fused(), 3, "bfloat16")
  state, _ = m.run_steps(engine, engine.init(params), batches[:2])
  with zj.Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(state)
  old = state
  state, losses = m.run_steps(engine, state, batches[2:])
  with pytest.raises(ValueError, match="updated in place"):
    engine.step(old, batches[0])
  # Restored into the fused engine, and into the XLA:CPU program's (optax's
  # own adamw under inject_hyperparams: the same state tree).
  with zj.Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
    again = ckpt.restore(engine, params)
    assert isinstance(jax.tree.leaves(again.params)[0], np.ndarray)
    xla = _engine(_optimizers()["adamw"][1](), 3, "bfloat16")
    other = ckpt.restore(xla, params)
  again, again_losses = m.run_steps(engine, again, batches[2:])
  other, other_losses = m.run_steps(xla, other, batches[2:])
  np.testing.assert_allclose(again_losses, losses, rtol=1e-6)
  np.testing.assert_allclose(other_losses, losses, rtol=1e-6)
  assert m.rel_err(engine.gather_params(again),
                   engine.gather_params(state)) == 0
  assert m.rel_err(xla.gather_params(other),
                   engine.gather_params(state)) < 1e-6


def test_bad_mask_names_the_fix():
  with pytest.raises(ValueError, match="tree of Python bools"):
    _engine(offload.adamw(1e-2, mask=lambda p: 1.0), 3).init(
        m.mlp_params())


# (stage, micro-batches, loss scope, reduce_dtype, gradient bytes a
# parameter): a global loss sums in bf16, a per-device one in float32
# unless reduce_dtype says bf16.
@pytest.mark.parametrize("stage,accum,scope,reduce,grad_bytes", [
    (0, None, "global", None, 2), (1, 2, "global", None, 2),
    (3, 2, "global", None, 2), (2, None, "per_device", None, 4),
    (3, None, "per_device", "bfloat16", 2),
    (2, 2, "per_device", "bfloat16", 2), (1, None, "per_device", "bfloat16",
                                          2)])
def test_traffic_count_is_the_arrays_moved(monkeypatch, stage, accum, scope,
                                           reduce, grad_bytes):
  # The count describe() states against the bytes of the gradients that
  # reach the host update and of each device's part of the compute copy
  # sent back: 16-bit both ways with bf16 compute, with accumulation too;
  # each leaf's copy sent as soon as it is written.
  # (Every copy to the device goes through FusedUpdate._send: the step's
  # leaf by leaf as the update writes them.)
  moved = {"up": [], "down": [], "order": []}
  update, send = offload.FusedUpdate.update, offload.FusedUpdate._send
  run = offload.FusedUpdate._run

  def counted_run(self, *args):
    moved["order"].append("update")
    return run(self, *args)

  def counted_update(self, grads, *args, **kwargs):
    moved["up"].append(sum(x.nbytes for x in jax.tree.leaves(grads)))
    return update(self, grads, *args, **kwargs)

  def counted_send(self, tree, shardings):
    out = send(self, tree, shardings)
    if all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(out)):
      # (A compute copy's, not the loss scale's.)
      moved["down"].append(sum(s.data.nbytes for x in jax.tree.leaves(out)
                               for s in x.addressable_shards))
      moved["order"].append("send")
    return out

  monkeypatch.setattr(offload.FusedUpdate, "update", counted_update)
  monkeypatch.setattr(offload.FusedUpdate, "_send", counted_send)
  monkeypatch.setattr(offload.FusedUpdate, "_run", counted_run)
  engine = zj.Engine(m.mlp_loss, offload.adamw(1e-2), zj.ZeroConfig(
      stage=stage, offload_optimizer="host", update_on="host",
      compute_dtype="bfloat16", grad_accum_steps=accum, loss_scope=scope,
      reduce_dtype=reduce, min_shard_elements=0 if stage != 1 else 2**20),
                     zj.make_mesh(num_devices=8))
  state = engine.init(m.mlp_params())
  moved["down"].clear()  # (the step's, not init's)
  moved["order"].clear()
  m.run_steps(engine, state, m.mlp_batches(1))
  down, up = engine.layout.update.traffic(engine.layout)
  n = analysis.param_count(m.mlp_params())
  assert moved["up"] == [up] and up == grad_bytes * n
  # Each leaf's copy leaves as soon as its update has written it.
  assert moved["order"] == ["update", "send"] * len(jax.tree.leaves(
      m.mlp_params()))
  assert sum(moved["down"]) == down
  assert f"{up / 2**20:,.1f} MiB of gradients" in engine.describe()


def test_host_update_moves_4_bytes_a_parameter_at_1_3b():
  # GPT-1.3B on one device, bf16 compute: 2 bytes of gradient up and 2 of
  # compute copy down (the bound is 4.5), counted from the layout alone.
  _, params = models.gpt_shapes(layers=24, hidden=2048, heads=16,
                                vocab=50304, seq_len=1024)
  engine = zj.Engine(lambda p, b: 0.0, offload.adamw(1e-4), zj.ZeroConfig(
      stage=3, offload_optimizer="host", update_on="host",
      compute_dtype="bfloat16"), zj.make_mesh(num_devices=1))
  engine.abstract_state(params)
  down, up = engine.layout.update.traffic(engine.layout)
  n = analysis.param_count(params)
  assert n > 1.3e9 and (up, down) == (2 * n, 2 * n)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_delay_update_runs_in_the_background_and_equals_optax(tmp_path,
                                                              dtype):
  # With delay_update the kernels run on the updater's thread while the
  # next step computes; what reads the state (the next update, a save,
  # gather_params) waits for them: training is the XLA:CPU program's
  # delayed update, and a save in between holds the settled state.
  fused, plain = _optimizers()["adamw"]
  params, batches = m.mlp_params(), m.mlp_batches(STEPS)
  engines = [zj.Engine(m.mlp_loss, tx(), zj.ZeroConfig(
      stage=2, offload_optimizer="host", update_on="host", delay_update=True,
      compute_dtype=dtype, clip_grad_norm=CLIP),
                       zj.make_mesh(num_devices=8)) for tx in (fused, plain)]
  runs = []
  for engine in engines:
    state = engine.init(params)
    state, losses = m.run_steps(engine, state, batches[:2])
    with zj.Checkpointer(tmp_path / str(len(runs))) as ckpt:
      ckpt.save(state)
    state, more = m.run_steps(engine, state, batches[2:])
    runs.append((losses + more, engine.gather_params(state)))
  host = engines[0].layout.update.host
  assert host.fused and host.background_updates == STEPS
  m.assert_matches(*runs[0], *runs[1], tol=1e-6)
  with zj.Checkpointer(tmp_path / "0", read_only=True) as a, \
      zj.Checkpointer(tmp_path / "1", read_only=True) as b:
    saved = [c.restore(e, params) for c, e in zip((a, b), engines)]
  assert m.rel_err(*(e.gather_params(s) for e, s in zip(engines, saved))
                   ) < 1e-6


@pytest.mark.parametrize("optimizer,scheduler", [
    ({"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
     {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
                                     "warmup_max_lr": 1e-2,
                                     "warmup_num_steps": 3}}),
    ({"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1,
                                 "adam_w_mode": False,
                                 "bias_correction": False}}, None),
    ({"type": "Lion", "params": {"lr": 1e-3, "weight_decay": 0.1}}, None),
    ({"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9,
                                "weight_decay": 0.01, "nesterov": True}},
     None),
    ({"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9,
                                "dampening": 0.1}}, None),
    ({"type": "SGD", "params": {"lr": 1e-2}}, None),
    ({"type": "Adagrad", "params": {"lr": 1e-2, "lr_decay": 0.1,
                                    "weight_decay": 0.01,
                                    "initial_accumulator_value": 0.1}},
     None)])
def test_deepspeed_optimizers_run_fused(optimizer, scheduler):
  # zj.initialize's FusedAdam (AdamW, Adam with L2, no bias correction),
  # FusedLion, SGD (Nesterov with L2, dampening, none) and Adagrad, with
  # DeepSpeed's and torch's formulas and schedule, run on the fused host
  # optimizer and equal the same transformation as an XLA:CPU program
  # (wrapped in a chain of its own, which the fused optimizer does not
  # know).
  ds = lambda: zj.config.optimizer_from_deepspeed(optimizer, scheduler)
  params, batches = m.mlp_params(), m.mlp_batches(STEPS)
  fused = _engine(ds(), 2, "bfloat16")
  losses, out, _ = m.train_engine(fused, params, batches)
  assert "DeepSpeed's, numba" in fused.describe()
  xla = _engine(optax.chain(ds()), 2, "bfloat16")
  ref_losses, ref, _ = m.train_engine(xla, params, batches)
  assert "XLA:CPU program" in xla.describe()
  m.assert_matches(losses, out, ref_losses, ref, tol=1e-6)
