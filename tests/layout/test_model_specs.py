"""The model's own layout: every source model_specs reads (explicit specs,
Linen boxes, logical names with rules, NNX metadata, array shardings) and
every mistake it reports, naming the parameter and the fix."""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tests import _tp_models as tp
from zero_jax.layout import make_mesh
from zero_jax.layout import model_specs
from zero_jax.layout._model_specs import is_model_parallel

M = ("model",)
D = ("data",)


@pytest.fixture(scope="module")
def mesh():
  return make_mesh(model=2)  # (data 4, model 2)


def _tree(specs):
  """``{"w": (8, 16), ...}`` of zeros."""
  return {k: jnp.zeros(shape) for k, shape in specs.items()}


# ----------------------------------------------------------- explicit specs


def test_explicit_specs_one_per_leaf(mesh):
  params = {"w": jnp.zeros((8, 16)), "b": jnp.zeros((16,)),
            "s": jnp.zeros(())}
  specs = {"w": P(None, "model"), "b": None, "s": P()}
  # Leaves in jax.tree.leaves order: b, s, w.
  assert model_specs(params, mesh, specs=specs) == [
      (None,), (), (None, M)]


def test_explicit_specs_short_spec_pads_and_axes_combine(mesh):
  params = {"w": jnp.zeros((8, 16, 4))}
  out = model_specs(params, mesh, specs={"w": P(("data", "model"))})
  assert out == [(("data", "model"), None, None)]


def test_explicit_named_sharding_and_prefix(mesh):
  params = {"a": {"x": jnp.zeros((4, 8)), "y": jnp.zeros((6, 8))},
            "b": jnp.zeros((8,))}
  specs = {"a": P(None, "model"),  # a prefix: both leaves below
           "b": NamedSharding(mesh, P("data"))}
  assert model_specs(params, mesh, specs=specs) == [
      (None, M), (None, M), (D,)]


def test_explicit_specs_win_over_metadata_and_shardings(mesh):
  sharded = jax.device_put(jnp.zeros((8, 16)),
                           NamedSharding(mesh, P(None, "model")))
  boxed = nn.Partitioned(jnp.zeros((8, 16)), names=("model", None))
  params = {"a": sharded, "b": boxed}
  specs = {"a": P("data"), "b": None}
  assert model_specs(params, mesh, specs=specs) == [(D, None),
                                                    (None, None)]


def test_explicit_specs_from_flax_fit_boxed_trees(mesh):
  params = _whole("linen")[0]
  specs = nn.logical_to_mesh(nn.get_partition_spec(params), tp.LINEN_RULES)
  assert model_specs(params, mesh, specs=specs) == model_specs(
      params, mesh, rules=tp.LINEN_RULES)
  state = _whole("nnx")[0]
  assert model_specs(state, mesh, specs=nnx.get_partition_spec(state)) == (
      model_specs(state, mesh))


def test_explicit_specs_with_another_structure_are_an_error(mesh):
  params = {"w": jnp.zeros((8, 16)), "b": jnp.zeros((16,))}
  with pytest.raises(ValueError, match="structure of params"):
    model_specs(params, mesh, specs={"w": P(None, "model")})


def test_a_tuple_instead_of_a_partition_spec_is_an_error(mesh):
  params = {"w": jnp.zeros((8, 16))}
  with pytest.raises(ValueError, match=r"specs at w/1: 'model' is not a "
                     r"PartitionSpec.*not a tuple"):
    model_specs(params, mesh, specs={"w": (None, "model")})


# --------------------------------------------------------------- Linen boxes


def test_linen_partitioned_names_mesh_axes(mesh):
  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      init = nn.with_partitioning(nn.initializers.lecun_normal(),
                                  (None, "model"))
      return nn.Dense(16, kernel_init=init)(x)

  params = Net().init(jax.random.PRNGKey(0), jnp.ones((1, 8)))["params"]
  assert isinstance(params["Dense_0"]["kernel"], nn.Partitioned)
  # bias (no box: not split), kernel.
  assert model_specs(params, mesh) == [(None,), (None, M)]


def _logical(names, shape=(8, 16), rules=None):
  return {"w": nn.LogicallyPartitioned(jnp.zeros(shape), names=names,
                                       rules=rules)}


def test_linen_logical_names_with_rules(mesh):
  params = _logical(("embed", "mlp"))
  assert model_specs(params, mesh, rules=tp.LINEN_RULES) == [(None, M)]
  # A list of lists works too.
  assert model_specs(params, mesh, rules=[["mlp", "model"]]) == [(None, M)]


def test_linen_rules_from_the_context_and_the_box(mesh):
  params = _logical(("embed", "mlp"))
  with nn.logical_axis_rules((("mlp", "model"),)):
    assert model_specs(params, mesh) == [(None, M)]
    # rules= stands in for the context's rules.
    assert model_specs(params, mesh, rules=(("embed", "model"),)) == [
        (M, None)]
  # The box's own rules win, as in Flax's unbox.
  own = _logical(("embed", "mlp"), rules=(("embed", "data"),))
  assert model_specs(own, mesh, rules=tp.LINEN_RULES) == [(D, None)]


def test_linen_logical_name_without_a_rule_is_whole(mesh):
  # As flax.linen.logical_to_mesh_axes maps it.
  params = _logical(("heads", "mlp"))
  assert model_specs(params, mesh, rules=(("mlp", "model"),)) == [
      (None, M)]
  assert model_specs(params, mesh, rules=()) == [(None, None)]


def test_linen_logical_names_without_any_rules_are_an_error(mesh):
  with pytest.raises(ValueError, match=r"w: nn.LogicallyPartitioned names "
                     r"P\('embed', 'mlp'\) but no logical axis "
                     r"rules.*rules=\(\)"):
    model_specs(_logical(("embed", "mlp")), mesh)


def test_linen_repeated_logical_name_names_the_leaf(mesh):
  with pytest.raises(ValueError, match=r"^w: .*occur more than once"):
    model_specs(_logical(("mlp", "mlp"), shape=(16, 16)), mesh,
                rules=tp.LINEN_RULES)


# ----------------------------------------------------------------------- NNX


def _nnx_state(names, shape=(8, 16), **metadata):
  return nnx.State({"w": nnx.Param(jnp.zeros(shape), eager_sharding=False,
                                   out_sharding=names, **metadata)})


def test_nnx_with_partitioning_mesh_names(mesh):
  state = _whole("nnx")[0]
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  got = {"/".join(str(k.key) for k in path[:2]): spec
         for (path, _), spec in zip(leaves, model_specs(state, mesh))}
  assert got == {"embed/embedding": (M, None), "up/kernel": (None, M),
                 "up/bias": (M,), "down/kernel": (M, None),
                 "down/bias": (None,), "norm/scale": (None,),
                 "norm/bias": (None,), "head/kernel": (None, M),
                 "head/bias": (M,)}
  assert is_model_parallel(model_specs(state, mesh))


def test_nnx_param_metadata_and_its_older_name(mesh):
  assert model_specs(_nnx_state((None, "model")), mesh) == [(None, M)]
  with warnings.catch_warnings():
    # (flax 0.12 calls sharding_names deprecated, for out_sharding.)
    warnings.simplefilter("ignore", DeprecationWarning)
    state = nnx.State({"w": nnx.Param(jnp.zeros((8, 16)),
                                      eager_sharding=False,
                                      sharding_names=("model", None))})
  assert model_specs(state, mesh) == [(M, None)]


def test_nnx_logical_names_with_rules_argument_context_and_own(mesh):
  state = _nnx_state(("embed", "mlp"))
  assert model_specs(state, mesh, rules=tp.LINEN_RULES) == [(None, M)]
  with nnx.logical_axis_rules(tp.LINEN_RULES):
    assert model_specs(state, mesh) == [(None, M)]
  own = _nnx_state(("embed", "mlp"), sharding_rules=(("embed", "model"),
                                                     ("mlp", None)))
  assert model_specs(own, mesh) == [(M, None)]


def test_nnx_logical_names_without_rules_are_an_error(mesh):
  # As in NNX, a name no rule maps is taken as a mesh axis name.
  with pytest.raises(ValueError, match=r"w \(shape \(8, 16\)\): NNX "
                     r"out_sharding \('embed', 'mlp'\).*axis 'embed' is not "
                     r"in the mesh.*\('mlp', 'model'\)"):
    model_specs(_nnx_state(("embed", "mlp")), mesh)


def test_metadata_is_the_source_for_the_whole_tree(mesh):
  # Once a tree has sharding metadata, a leaf without it is whole, even if
  # its array happens to be split.
  sharded = jax.device_put(jnp.zeros((8, 16)),
                           NamedSharding(mesh, P("model")))
  state = nnx.State({
      "a": nnx.Param(sharded),
      "b": nnx.Param(jnp.zeros((8, 16)), eager_sharding=False,
                     out_sharding=(None, "model"))})
  assert model_specs(state, mesh) == [(None, None), (None, M)]
  linen = {"a": sharded,
           "b": nn.Partitioned(jnp.zeros((8, 16)), names=(None, "model"))}
  assert model_specs(linen, mesh) == [(None, None), (None, M)]


def test_nnx_without_any_metadata_reads_the_arrays(mesh):
  sharded = jax.device_put(jnp.zeros((8, 16)),
                           NamedSharding(mesh, P("model")))
  state = nnx.State({"w": nnx.Param(sharded)})
  assert model_specs(state, mesh) == [(M, None)]


# ----------------------------------------------------------- array shardings


def test_array_and_shape_shardings(mesh):
  params = {
      "a": jax.device_put(jnp.zeros((8, 16)),
                          NamedSharding(mesh, P(None, ("data", "model")))),
      "b": jax.ShapeDtypeStruct((8, 16), jnp.float32,
                                sharding=NamedSharding(mesh, P("model"))),
      "c": jax.ShapeDtypeStruct((8,), jnp.float32),
      "d": np.zeros((4, 4)),
      "e": jnp.zeros((6,)),
  }
  assert model_specs(params, mesh) == [
      (None, ("data", "model")), (M, None), (None,), (None, None), (None,)]


def test_nothing_split_without_any_source(mesh):
  out = model_specs(_tree({"w": (8, 16), "b": (16,)}), mesh)
  assert out == [(None,), (None, None)]
  assert not is_model_parallel(out)


class _Split:
  """A sharding that splits an array but names no mesh axes."""

  is_fully_replicated = False


class _Leaf:
  shape = (8, 8)
  sharding = _Split()


def test_a_split_without_mesh_axes_is_an_error(mesh):
  with pytest.raises(ValueError, match=r"^w: the array is split by a "
                     r"_Split.*NamedSharding"):
    model_specs({"w": _Leaf()}, mesh)


# ---------------------------------------------------- checks against the mesh


def test_an_axis_not_in_the_mesh(mesh):
  with pytest.raises(ValueError, match=r"layer/w \(shape \(8, 16\)\): specs "
                     r"gives P\(None, 'tensor'\): axis 'tensor' "
                     r"is not in the mesh.*'data', 'model' and 'replica'.*"
                     r"\('mlp', 'model'\)"):
    model_specs({"layer": {"w": jnp.zeros((8, 16))}}, mesh,
                specs={"layer": {"w": P(None, "tensor")}})


@pytest.mark.parametrize("replica", [1, 2])
def test_the_replica_axis(replica):
  mesh = make_mesh(replica=replica, model=2)
  with pytest.raises(ValueError, match=r"^w .*dimension 0 is split over "
                     r"'replica'.*whole copies"):
    model_specs({"w": jnp.zeros((8, 16))}, mesh,
                specs={"w": P("replica", "model")})


def test_a_spec_longer_than_the_rank(mesh):
  with pytest.raises(ValueError, match=r"^b \(shape \(16,\)\): nn."
                     r"Partitioned names P\(None, 'model'\): 2 "
                     r"entries for a leaf of rank 1"):
    model_specs({"b": nn.Partitioned(jnp.zeros((16,)),
                                     names=(None, "model"))}, mesh)


def test_a_dimension_its_axes_do_not_divide():
  mesh = make_mesh(model=4)
  with pytest.raises(ValueError, match=r"^w \(shape \(6, 8\)\).*dimension 0 "
                     r"has size 6, which \('model',\) \(size 4 on this "
                     r"mesh\) does not divide"):
    model_specs({"w": jnp.zeros((6, 8))}, mesh, specs={"w": P("model")})
  with pytest.raises(ValueError, match=r"size 8 on this mesh"):
    model_specs({"w": jnp.zeros((4, 8))}, make_mesh(model=2),
                specs={"w": P(("data", "model"))})


@pytest.mark.parametrize("spec", [P("model", "model"),
                                  P(("data", "model"), "model"),
                                  P(("model", "model"))])
def test_one_axis_on_two_dimensions(mesh, spec):
  with pytest.raises(ValueError, match=r"^w .*axis 'model' splits "
                     r"dimension \d and dimension \d.*one dimension only"):
    model_specs({"w": jnp.zeros((8, 8))}, mesh, specs={"w": spec})


def test_an_unconstrained_entry(mesh):
  with pytest.raises(ValueError, match=r"is not None, a mesh axis name"):
    model_specs({"w": jnp.zeros((8, 8))}, mesh,
                specs={"w": P(P.UNCONSTRAINED)})


def test_malformed_rules(mesh):
  with pytest.raises(ValueError, match=r"rules: 'mlp' is not a \(logical "
                     r"name, mesh axes\) pair"):
    model_specs(_logical(("embed", "mlp")), mesh, rules=("mlp", "model"))


def test_axes_of_size_one_are_dropped():
  params = {"w": jnp.zeros((8, 16))}
  specs = {"w": P("data", "model")}
  # data 1, model 2: the data entry splits nothing.
  assert model_specs(params, make_mesh(num_devices=2, model=2),
                     specs=specs) == [(None, M)]
  # make_mesh(model=1) has no model axis: a tensor-parallel model runs
  # unchanged, whole.
  out = model_specs(params, make_mesh(), specs=specs)
  assert out == [(D, None)]
  assert not is_model_parallel(out)


# ---------------------------------------------- the tensor-parallel models

_MESHES = {"d4m2": dict(model=2), "d2m4": dict(model=4),
           "r2d2m2": dict(replica=2, model=2)}
_MODELS = {"nnx": (tp.nnx_init, tp.nnx_loss, None),
           "linen": (tp.linen_init, tp.linen_loss, tp.LINEN_RULES)}


@functools.cache
def _whole(model):
  """The model's whole parameters and their loss on the first batch, once
  per file (every mesh compares with them)."""
  init, loss_fn, _ = _MODELS[model]
  whole = init()
  # (Jitted: one compile instead of one per operation.)
  return whole, jax.jit(loss_fn)(whole, tp.tp_batches(1)[0])


@pytest.mark.parametrize("mesh_name", sorted(_MESHES))
@pytest.mark.parametrize("model", sorted(_MODELS))
def test_tp_models_read_the_same_specs_sharded_or_not(model, mesh_name):
  mesh = make_mesh(**_MESHES[mesh_name])
  init, loss_fn, rules = _MODELS[model]
  (whole, whole_loss), sharded = _whole(model), init(mesh=mesh)
  specs = model_specs(whole, mesh, rules=rules)
  assert is_model_parallel(specs)
  assert model_specs(sharded, mesh, rules=rules) == specs
  # The sharded arrays themselves, without metadata, say the same.
  arrays = jax.tree.leaves(sharded)
  assert model_specs(arrays, mesh) == specs
  assert all(x.sharding.is_fully_replicated
             for x in jax.tree.leaves(whole))
  # Same values either way, so exactness tests can start from either.
  for a, b in zip(jax.tree.leaves(whole), arrays):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  batch = tp.tp_batches(1)[0]
  np.testing.assert_allclose(jax.jit(loss_fn)(sharded, batch), whole_loss,
                             rtol=1e-6)


def test_tp_model_abstract_params_give_the_same_specs(mesh):
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: tp.NNXModel(rngs=nnx.Rngs(0)))
  abstract = nnx.split(model, nnx.Param)[1]
  assert model_specs(abstract, mesh) == model_specs(_whole("nnx")[0],
                                                    mesh)
  abstract = jax.eval_shape(tp.LINEN_MODEL.init, jax.random.PRNGKey(0),
                            jnp.zeros((1, tp.SEQ), jnp.int32))["params"]
  assert model_specs(abstract, mesh, rules=tp.LINEN_RULES) == model_specs(
      _whole("linen")[0], mesh, rules=tp.LINEN_RULES)


def test_linen_apply_takes_boxed_params_and_boxes_the_gradient():
  (params, boxed), batch = _whole("linen"), tp.tp_batches(1)[0]
  np.testing.assert_allclose(
      boxed, jax.jit(tp.linen_loss)(nn.unbox(params), batch), rtol=1e-6)
  assert 3.0 < float(boxed) < 8.0  # about log(64) = 4.2 at init
  # (Jitted: one compile instead of one per operation.)
  grads = jax.jit(jax.grad(tp.linen_loss))(params, batch)
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  assert isinstance(grads["Dense_0"]["kernel"], nn.LogicallyPartitioned)


def test_nnx_loss_differentiates_the_state():
  params, batch = _whole("nnx")[0], tp.tp_batches(1)[0]
  grads = jax.jit(jax.grad(tp.nnx_loss))(params, batch)
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads))


def test_tp_batches_are_deterministic_next_tokens():
  a, b = tp.tp_batches(2), tp.tp_batches(2)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["tokens"], y["tokens"])
  assert a[0]["tokens"].shape == (16, tp.SEQ)
  np.testing.assert_array_equal(a[0]["tokens"][:, 1:],
                                a[0]["labels"][:, :-1])
  assert not np.array_equal(a[0]["tokens"], a[1]["tokens"])
