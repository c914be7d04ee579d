"""ZeRO composed with tensor parallelism: every stage on (data x model)
meshes equals single-device optax, each model split by its own specs, the
state split over both axes, and no mesh axis silently ignored.

The grid of models x meshes x stages runs pairwise by default (every model
at every stage and on every mesh, every mesh at every stage); the rest of
it is marked ``exhaustive`` (``pytest -m exhaustive``)."""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from tests import _models as m
from tests import _tp_models as tpm
from tests.train import _shared
from zero_jax import analysis
from zero_jax.layout import DATA, MODEL

STEPS = 3
# (replica, model): (data 4, model 2), (data 2, model 4), (replica 2,
# data 2, model 2) on the 8 devices of tests/conftest.py.
MESHES = {"d4m2": (1, 2), "d2m4": (1, 4), "r2d2m2": (2, 2)}


def _mesh(name):
  replica, model = MESHES[name]
  return zj.make_mesh(replica=replica, model=model)


def _gpt():
  loss_fn, params, batches = m.gpt_setup(steps=STEPS)
  return loss_fn, params, batches, optax.adamw(1e-3, weight_decay=0.1), {}


def _nnx():
  return (tpm.nnx_loss, tpm.nnx_init(), tpm.tp_batches(STEPS),
          optax.adamw(1e-2, weight_decay=0.1), {})


def _linen():
  # (Momentum, not Adam: Adam's normalization turns this model's fp32
  # reordering noise in near-zero bias gradients into 1e-4 differences,
  # with or without tensor parallelism.)
  return (tpm.linen_loss, tpm.linen_init(), tpm.tp_batches(STEPS),
          optax.sgd(0.1, momentum=0.9), {"axis_rules": tpm.LINEN_RULES})


MODELS = {"gpt": _gpt, "nnx": _nnx, "linen": _linen}


@functools.cache
def _reference(model):
  loss_fn, params, batches, tx, _ = MODELS[model]()
  return m.train_reference(loss_fn, tx, params, batches)


def _split_over(state, axis):
  """Paths of the master leaves whose sharding names ``axis``."""
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(state.params)[0]:
    names = [a for e in x.sharding.spec if e is not None
             for a in ((e,) if isinstance(e, str) else e)]
    if axis in names:
      out.append(jax.tree_util.keystr(path))
  return out


STAGES = [0, 1, 2, 3]


def _grid():
  return [(model, mesh_name, stage) for model in sorted(MODELS)
          for mesh_name in sorted(MESHES) for stage in STAGES]


def _default(model, mesh_name, stage):
  # A Latin square: each (mesh, stage) once, its model rotating, so each
  # model meets every mesh and every stage (the GPT's scanned layers at
  # every stage). (Shifted by one so that the NNX model runs at stage 3 on
  # d4m2, the engine the tests below compile again.)
  i = (stage + sorted(MESHES).index(mesh_name) + 1) % len(MODELS)
  return model == sorted(MODELS)[i]


@pytest.mark.parametrize("model,mesh_name,stage", [
    pytest.param(*c, marks=() if _default(*c) else pytest.mark.exhaustive)
    for c in _grid()])
def test_every_stage_and_mesh_matches_single_device_optax(model, mesh_name,
                                                           stage):
  loss_fn, params, batches, tx, kwargs = MODELS[model]()
  ref_losses, ref_params = _reference(model)
  mesh = _mesh(mesh_name)
  engine = zj.Engine(loss_fn, tx,
                     zj.ZeroConfig(stage=stage, min_shard_elements=0),
                     mesh, **kwargs)
  losses, params_out, state = m.train_engine(engine, params, batches)
  m.assert_matches(losses, params_out, ref_losses, ref_params)
  # The model's split is real: the master is split over 'model' where the
  # model says, and over 'data' from stage 3 (at stages 1-2 the moments).
  assert _split_over(state, MODEL), "no parameter split over 'model'"
  if stage == 3:
    assert _split_over(state, DATA)
  if stage >= 1:
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert any(DATA in str(x.sharding.spec) and MODEL in str(x.sharding.spec)
               for x in moments)


def test_the_default_run_covers_the_grid_pairwise():
  grid = _grid()
  assert not _shared.uncovered_pairs(grid, [c for c in grid
                                            if _default(*c)])


def _nnx_engine(config, mesh, **kwargs):
  return zj.Engine(tpm.nnx_loss, optax.adamw(1e-2, weight_decay=0.1),
                   config, mesh, **kwargs)


def test_state_per_device_is_one_over_data_times_model():
  mesh = _mesh("d2m4")
  engine = _nnx_engine(zj.ZeroConfig(stage=3, min_shard_elements=0), mesh)
  state = engine.init(tpm.nnx_init())
  held = sum(x.addressable_shards[0].data.size
             for x in jax.tree.leaves(state.params))
  # Each device holds 1/(data x model) of the split leaves, 1/data of the
  # rest (layer norms): data 2, model 4.
  plans = [lp for _, lp in engine.param_plan.rows()]
  assert all(lp.sharded for lp in plans)
  assert any(lp.model_split for lp in plans)
  want = sum(int(np.prod(lp.shape)) // (8 if lp.model_split else 2)
             for lp in plans)
  assert held == want
  text = engine.describe()
  assert "tensor parallelism on 'model'" in text
  assert "P('data', 'model')" in text or "P('model', 'data')" in text


def test_the_splits_come_from_specs_metadata_or_arrays_alike():
  mesh = _mesh("d4m2")
  config = zj.ZeroConfig(stage=3, min_shard_elements=0)
  from_metadata = _nnx_engine(config, mesh)
  from_metadata.init(tpm.nnx_init())
  # The same split from arrays already placed over 'model' (created under
  # jax.set_mesh), and from an explicit tree of PartitionSpecs.
  from_arrays = _nnx_engine(config, mesh)
  from_arrays.init(tpm.nnx_init(mesh=mesh))
  specs = jax.tree.map(lambda lp: P(*[MODEL if s else None
                                      for s in lp.model]),
                       from_metadata.param_plan.leaves,
                       is_leaf=lambda x: hasattr(x, "model"))
  from_specs = zj.Engine(m.mlp_loss, optax.sgd(0.1), config, mesh,
                         model_specs=specs)
  from_specs.init(tpm.nnx_init())
  rows = lambda e: [(p, lp.global_spec) for p, lp in e.param_plan.rows()]
  assert rows(from_metadata) == rows(from_arrays) == rows(from_specs)


def test_an_unused_mesh_axis_is_an_error():
  devices = np.array(jax.devices()).reshape(4, 2)
  mesh = jax.sharding.Mesh(devices, (DATA, "tensor"))
  with pytest.raises(ValueError, match="'tensor'.*'model'"):
    _nnx_engine(zj.ZeroConfig(stage=3), mesh)
  # A model axis the parameters are not split over repeats the same work.
  engine = zj.Engine(m.mlp_loss, optax.sgd(0.1), zj.ZeroConfig(stage=3),
                     _mesh("d4m2"))
  with pytest.raises(ValueError, match="no parameter is split over it"):
    engine.init(m.mlp_params())


def _loop_gpt_specs(params):
  """Megatron specs for zero_jax.models.loop_gpt's NNX blocks, by path."""
  def spec(path, x):
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    if "kernel" in names and ("qkv" in names or "up" in names):
      return P(None, MODEL)
    if "kernel" in names and ("proj" in names or "down" in names):
      return P(MODEL, None)
    if "bias" in names and "up" in names:
      return P(MODEL)
    return P()
  return jax.tree_util.tree_map_with_path(spec, params)


def test_blocks_run_one_at_a_time_compose():
  # Blocks called in a Python loop (zero_jax.layers' per-block gathering),
  # split by an explicit tree of PartitionSpecs.
  from zero_jax.models import loop_gpt
  loss_fn, params = loop_gpt("nnx", vocab=64, d=32, heads=4, layers=2)
  rng = np.random.default_rng(0)
  batches = [{"x": rng.integers(0, 64, (16, 8), dtype=np.int32),
              "y": rng.integers(0, 64, (16, 8), dtype=np.int32)}
             for _ in range(STEPS)]
  tx = optax.adamw(1e-2)
  reference = m.train_reference(loss_fn, tx, params, batches)
  mesh = _mesh("d4m2")
  engine = zj.Engine(loss_fn, tx, zj.ZeroConfig(stage=3,
                                                min_shard_elements=0),
                     mesh, model_specs=_loop_gpt_specs(params))
  losses, out, _ = m.train_engine(engine, params, batches)
  # Adam at lr 1e-2 turns fp32 reordering into errors near 1e-5 here, so
  # the bound is a multiple of plain jax.jit's own on the same mesh
  # (measured: jax 0.10 lands 3.2e-6 from one device, this engine 9.3e-6;
  # jax 0.12 6.3e-6 and 1.9e-5).
  floor = m.reduction_floor(loss_fn, tx, params, batches, mesh, reference)
  m.assert_matches(losses, out, *reference, tol=m.floor_tolerance(floor))
  assert engine.units_seen, "the blocks did not run one at a time"


@pytest.mark.parametrize("extra,reference_tx", [
    ({"stage": 3, "grad_accum_steps": 2}, None),
    ({"stage": 1, "clip_grad_norm": 0.05}, "clip"),
    ({"stage": 3, "offload_optimizer": "host"}, None),
    ({"stage": 3, "offload_optimizer": "host", "offload_params": "host"},
     None),
    ({"stage": 2, "update_on": "host", "offload_optimizer": "host"}, None),
])
def test_accumulation_clipping_and_offload_compose(extra, reference_tx):
  batches = tpm.tp_batches(STEPS)
  tx = optax.adamw(1e-2, weight_decay=0.1)
  if reference_tx == "clip":
    ref_losses, ref_params = m.train_reference(
        tpm.nnx_loss, optax.chain(optax.clip_by_global_norm(0.05), tx),
        tpm.nnx_init(), batches)
  else:  # (the grid's: the same optimizer on the same batches)
    ref_losses, ref_params = _reference("nnx")
  engine = zj.Engine(tpm.nnx_loss, tx,
                     zj.ZeroConfig(min_shard_elements=0, **extra),
                     _mesh("d4m2"))
  losses, out, _ = m.train_engine(engine, tpm.nnx_init(), batches)
  m.assert_matches(losses, out, ref_losses, ref_params)


@pytest.mark.parametrize("compute_dtype", ["float16", "bfloat16"])
def test_mixed_precision_equals_the_data_parallel_engine(compute_dtype):
  # 16-bit compute is not fp32-exact: tensor parallelism must not change it
  # beyond the reordered sums of the split matmuls.
  batches = tpm.tp_batches(STEPS)
  config = zj.ZeroConfig(stage=3, min_shard_elements=0,
                         compute_dtype=compute_dtype)
  runs = []
  for mesh in (zj.make_mesh(num_devices=4), _mesh("d4m2")):
    engine = _nnx_engine(config, mesh)
    runs.append(m.train_engine(engine, tpm.nnx_init(), batches)[:2])
  (l0, p0), (l1, p1) = runs
  np.testing.assert_allclose(l1, l0, rtol=2e-3)
  assert m.rel_err(p1, p0) < 2e-2


def test_the_hlo_has_zero_collectives_over_data_and_tp_over_model():
  mesh = _mesh("d4m2")
  # (The per-device step's own collectives: on CPU the global step's
  # compiler all-reduces gradients; tests/train/test_loss_scope.py's.)
  engine = _nnx_engine(zj.ZeroConfig(stage=3, min_shard_elements=0,
                                     loss_scope="per_device"), mesh)
  state = engine.init(tpm.nnx_init())
  batch = engine.shard_batch(tpm.tp_batches(1)[0])
  hlo = engine.step.lower(state, batch).compile().as_text()
  ops = analysis.collectives(hlo)
  along = {}
  for op in ops:
    along.setdefault((op.kind, op.axes(mesh)), []).append(op)
  assert ("all-gather", (DATA,)) in along, sorted(along)
  assert ("reduce-scatter", (DATA,)) in along, sorted(along)
  # Tensor parallelism's own: the row-parallel partial sums over 'model'.
  assert any(axes == (MODEL,) for _, axes in along), sorted(along)
  # ZeRO's gathers move each model rank's slice only: no gather over data
  # of a weight whole over 'model' (the up projection is (32, 128) with
  # 128 over 'model', so a data gather yields (32, 64), never (32, 128)).
  shapes = {s for op in along[("all-gather", (DATA,))] for s in op.shapes}
  assert (tpm.EMBED, tpm.HIDDEN // 2) in shapes, shapes
  assert (tpm.EMBED, tpm.HIDDEN) not in shapes, shapes


@pytest.mark.parametrize("remat,names", [
    ("full", ()),
    # Pa+cpu: the split layer inputs in host memory (on CPU the copy moves
    # nothing, but the step takes the offload path and stays exact).
    ("offload_to_host", ("layer_input",)),
])
def test_partitioned_activations_train_exactly(remat, names):
  loss_fn, params, batches, tx, _ = _gpt()
  ref_losses, ref_params = _reference("gpt")
  config = zj.ZeroConfig(stage=3, min_shard_elements=0, remat=remat,
                         remat_names=names, partition_activations=True)
  engine = zj.Engine(loss_fn, tx, config, _mesh("d4m2"))
  losses, out, state = m.train_engine(engine, params, batches)
  m.assert_matches(losses, out, ref_losses, ref_params)
  # The layer scan carries its input split over 'model' along the
  # sequence: (layers 2, batch 4 per data rank, seq 16 / 2, d 32).
  hlo = engine.step.lower(state, engine.shard_batch(batches[0])).compile(
  ).as_text()
  assert "f32[2,4,8,32]" in hlo and "f32[2,4,16,32]" not in hlo


def test_partitioned_activations_need_a_divisible_sequence():
  loss_fn, params, batches, tx, _ = _gpt()
  engine = zj.Engine(loss_fn, tx, zj.ZeroConfig(stage=3,
                                                partition_activations=True),
                     _mesh("d4m2"))
  state = engine.init(params)
  short = {"tokens": batches[0]["tokens"][:, :8]}  # seq 7: odd
  with pytest.raises(ValueError, match="partition_activations.*sequence"):
    engine.step(state, short)
