"""The JAX internals zero_jax reads (all in zero_jax/_compat.py) are where
the installed JAX keeps them.

Each helper falls back quietly where a JAX version has moved its internal:
without this test, an upgrade would switch those paths off unnoticed.
"""

import jax

from zero_jax import _compat


def test_backends_started_reads_jax():
  jax.devices()  # (the suite's backends are up)
  assert _compat.backends_started() is True


def test_the_distributed_state_is_jaxs():
  state = _compat.distributed_state()
  assert state is not None
  for name in ("client", "process_id", "num_processes"):
    assert hasattr(state, name), name


def test_jax_names_its_cluster_environments():
  kinds = _compat.cluster_kinds()
  assert kinds, "jax's ClusterEnv registry moved"
  names = {k.__name__ for k in kinds}
  assert {"SlurmCluster", "OmpiCluster"} <= names, names
  assert all(callable(getattr(k, "is_env_present", None)) for k in kinds)


def test_varying_axes_reads_the_type_inside_shard_map():
  mesh = jax.make_mesh((8,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  seen = []

  def f(x):
    seen.append(_compat.varying_axes(x))
    return x

  jax.shard_map(f, mesh=mesh, in_specs=jax.sharding.PartitionSpec("data"),
                out_specs=jax.sharding.PartitionSpec("data"))(
                    jax.numpy.zeros(8))
  assert seen == [frozenset({"data"})]
