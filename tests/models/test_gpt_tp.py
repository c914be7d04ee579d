"""The reference GPT's tensor-parallel specs: Megatron-style splits over the
``model`` mesh axis in its Flax metadata, heads kept whole by the QKV
packing, and the same loss and gradients as on one device when the
compiler splits it by those specs (no engine)."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.sharding import SingleDeviceSharding

import zero_jax as zj
from zero_jax.analysis import collectives
from zero_jax.layout import DATA, MODEL
from zero_jax.models import GPT, GPTConfig, make_loss_fn
from zero_jax.models._attention import causal_self_attention

# Every parameter's split over "model" (Megatron-LM): column-parallel QKV and
# MLP-in, row-parallel attention-out and MLP-out, vocabulary-parallel
# embedding and head; the layer axis (first of the block stacks) is whole.
EXPECTED = {
    "tok_emb": P(MODEL, None),
    "pos_emb": P(None, None),
    "head": P(None, MODEL),
    "ln_f_scale": P(None),
    "ln_f_bias": P(None),
    "blocks/ln1_scale": P(None, None),
    "blocks/ln1_bias": P(None, None),
    "blocks/attn_qkv": P(None, None, MODEL),
    "blocks/attn_out": P(None, MODEL, None),
    "blocks/attn_out_bias": P(None, None),
    "blocks/ln2_scale": P(None, None),
    "blocks/ln2_bias": P(None, None),
    "blocks/mlp_in": P(None, None, MODEL),
    "blocks/mlp_in_bias": P(None, MODEL),
    "blocks/mlp_out": P(None, MODEL, None),
    "blocks/mlp_out_bias": P(None, None),
}

# Small, but every split divides by M = 4: vocab 64, heads 4, d_ff 128.
_CFG = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4,
            attention="einsum")


def _by_path(tree) -> dict:
  """``{"blocks/attn_qkv": leaf, ...}`` of an ``nnx.State``."""
  flat = nnx.to_flat_state(tree)
  return {"/".join(str(k) for k in path): v for path, v in flat}


def _specs(params) -> dict[str, P]:
  """Each parameter's ``PartitionSpec``, read by Flax's public API."""
  return {k: v.get_value() for k, v in
          _by_path(nnx.get_partition_spec(params)).items()}


def _params(cfg: GPTConfig, seed: int = 0):
  return nnx.split(GPT(cfg, rngs=nnx.Rngs(seed)), nnx.Param)


def test_every_parameter_carries_its_megatron_split():
  _, params = _params(GPTConfig())
  assert _specs(params) == EXPECTED
  # Stored under Flax's own metadata key, one entry per dimension.
  for path, var in _by_path(params).items():
    assert var.get_metadata()["out_sharding"] == tuple(EXPECTED[path])
    assert len(EXPECTED[path]) == var.get_value().ndim, path


def test_outside_a_mesh_the_model_is_made_as_without_specs():
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no deprecated metadata spelling
    model = GPT(GPTConfig(), rngs=nnx.Rngs(0))
  for path, var in _by_path(nnx.state(model, nnx.Param)).items():
    assert isinstance(var.get_value().sharding, SingleDeviceSharding), path
    assert not var.get_metadata()["eager_sharding"], path
  tokens = jnp.arange(64).reshape(1, 64) % 256
  assert model(tokens).shape == (1, 64, 256)


@pytest.mark.parametrize("model", [1, 2, 4])
def test_under_a_mesh_parameters_are_created_by_their_specs(model):
  _, eager = _params(GPTConfig(**_CFG))
  mesh = zj.make_mesh(model=model)
  with jax.set_mesh(mesh):
    _, placed = _params(GPTConfig(**_CFG))
  eager, placed = _by_path(eager), _by_path(placed)
  for path, var in placed.items():
    value = var.get_value()
    np.testing.assert_array_equal(np.asarray(value),
                                  np.asarray(eager[path].get_value()))
    if model > 1:
      # Split as its metadata says (M devices hold 1/M of a split dim).
      assert value.sharding.spec == EXPECTED[path], path
      local = value.addressable_shards[0].data.shape
      want = tuple(n // model if s == MODEL else n
                   for n, s in zip(value.shape, EXPECTED[path]))
      assert local == want, path
    else:
      # No "model" axis: nothing to split over, nothing applied.
      assert not var.get_metadata()["eager_sharding"], path


@pytest.mark.parametrize("m", [2, 4])
def test_qkv_columns_split_contiguously_give_each_rank_whole_heads(m):
  """Megatron's attention: rank r takes the r-th contiguous block of QKV
  columns and of attention-out rows, attends over its own heads alone, and
  the partial outputs sum to the whole attention."""
  d, heads = 32, 4
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (2, 8, d))
  qkv_w = jax.random.normal(k[1], (d, 3 * d)) / np.sqrt(d)
  out_w = jax.random.normal(k[2], (d, d)) / np.sqrt(d)
  out_b = jax.random.normal(k[3], (d,))
  whole = causal_self_attention(x, qkv_w, out_w, out_b, heads)
  c, r = 3 * d // m, d // m
  parts = sum(causal_self_attention(x, qkv_w[:, i * c:(i + 1) * c],
                                    out_w[i * r:(i + 1) * r],
                                    jnp.zeros(d), heads // m)
              for i in range(m))
  np.testing.assert_allclose(parts + out_b, whole, rtol=1e-5, atol=1e-6)


def _batch(cfg: GPTConfig) -> dict[str, jax.Array]:
  tokens = jax.random.randint(jax.random.key(1), (8, cfg.seq_len + 1), 0,
                              cfg.vocab_size)
  return {"tokens": tokens}


@functools.cache
def _sharded_step(model: int, loss_chunk: int | None):
  """``value_and_grad`` of the GPT's loss with its parameters placed by
  their specs on a (data, model) mesh and the batch split over data; one
  per (model, loss_chunk), shared by the tests (jax keeps its compiled
  program with it).

  Returns:
    (the jitted function, placed params, placed batch, single-device
    params, single-device batch, mesh).
  """
  cfg = GPTConfig(**_CFG, loss_chunk=loss_chunk)
  graphdef, params = _params(cfg)
  batch = _batch(cfg)
  mesh = zj.make_mesh(model=model)
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                           nnx.get_partition_spec(params))
  placed = jax.device_put(params, shardings)
  placed_batch = jax.device_put(batch, NamedSharding(mesh, P(DATA)))
  step = jax.jit(jax.value_and_grad(make_loss_fn(graphdef)))
  return step, placed, placed_batch, params, batch, mesh


@functools.cache
def _one_device(loss_chunk: int | None):
  """The loss and gradients on one device (the model=2 step's function on
  uncommitted arrays), whatever the mesh the others are compared on."""
  step, _, _, params, batch, _ = _sharded_step(2, loss_chunk)
  return step(params, batch)


def _rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("loss_chunk", [None, 32])
@pytest.mark.parametrize("model", [2, 4])
def test_model_parallel_loss_and_grads_match_one_device(model, loss_chunk):
  step, placed, placed_batch, _, _, _ = _sharded_step(model, loss_chunk)
  # The split is real: each device holds 1/M of the head's vocabulary.
  head = _by_path(placed)["head"].get_value()
  assert head.addressable_shards[0].data.shape == (32, 64 // model)

  loss, grads = step(placed, placed_batch)
  ref_loss, ref_grads = _one_device(loss_chunk)   # uncommitted: one device
  assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
  got, want = _by_path(grads), _by_path(ref_grads)
  assert set(got) == set(EXPECTED)
  errors = {p: _rel_err(got[p].get_value(), want[p].get_value())
            for p in got}
  assert max(errors.values()) <= 1e-5, errors


def _collectives(step, params, batch) -> list:
  """The compiled step's all-reduces, all-gathers and reduce-scatters, with
  their replica groups (zero_jax.analysis reads them)."""
  hlo = step.lower(params, batch).compile().as_text()
  kinds = ("all-reduce", "all-gather", "reduce-scatter")
  return [c for c in collectives(hlo) if c.kind in kinds]


@pytest.mark.parametrize("loss_chunk", [None, 32])
def test_compiled_step_communicates_within_model_groups(loss_chunk):
  step, placed, placed_batch, params, _, mesh = _sharded_step(2, loss_chunk)
  # Row-parallel partial sums are reduced within each model group: on
  # (data 4, model 2), pairs of consecutive devices.
  along = [c for c in _collectives(step, placed, placed_batch)
           if c.axes(mesh) == (MODEL,)]
  assert along
  for c in along:
    assert sorted(c.groups) == [(0, 1), (2, 3), (4, 5), (6, 7)], c
  # (Not so when the same step gets its parameters replicated.)
  whole = jax.device_put(params, NamedSharding(mesh, P()))
  assert not [c for c in _collectives(step, whole, placed_batch)
              if c.axes(mesh) == (MODEL,)]
