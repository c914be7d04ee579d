"""``engine.init`` copies the caller's parameters: no buffer of theirs ends
up in the state, so the steps that donate it never delete or overwrite
them, at every stage and offload setting (pairwise over the stage and the
offload settings by default; every case with ``-m exhaustive``)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zero_jax as zj
from tests import _models as m
from tests.train import _shared

_TX = lambda: optax.adamw(1e-2, weight_decay=0.1)
_STEPS = 3

# Every stage and offload setting the CPU runs: the update on the device,
# streamed through it, or on the host's CPU devices.
_OFFLOADS = {
    "none": {},
    "optimizer": dict(offload_optimizer="host"),
    "optimizer, host update": dict(offload_optimizer="host",
                                   update_on="host"),
}
_STAGE_3_OFFLOADS = {
    "params": dict(offload_params="host"),
    "params, host update": dict(offload_params="host", update_on="host"),
    "both": dict(offload_optimizer="host", offload_params="host"),
}
_CASES = ([(stage, name) for stage in (0, 1, 2, 3) for name in _OFFLOADS] +
          [(3, name) for name in _STAGE_3_OFFLOADS])


def _flags(stage, offload):
  """(stage, offload_optimizer, offload_params, update_on) of a case."""
  config = {**_OFFLOADS, **_STAGE_3_OFFLOADS}[offload]
  return (stage, config.get("offload_optimizer"),
          config.get("offload_params"), config.get("update_on", "device"))


def _default(stage, offload):
  # Pairwise over the four settings (each pair of values any two of them
  # take in _CASES): at stages 0-2 nothing offloaded and the optimizer on
  # the host's CPU devices; at stage 3 the rest. The other cases are
  # marked exhaustive.
  if stage < 3:
    return offload in ("none", "optimizer, host update")
  return offload in ("none", "optimizer, host update", "params, host update",
                     "both")


def _callers_params(mesh) -> dict:
  """The awkward model's parameters as a caller may hold them: jax arrays
  on the default device (small ones the layout replicates, and a
  scalar), one already replicated over the mesh, and numpy arrays."""
  params = m.awkward_params()
  params["m13x24"] = jax.device_put(params["m13x24"],
                                    NamedSharding(mesh, P()))
  for name in ("t357", "w"):
    params[name] = np.asarray(params[name])
  return params


@functools.cache
def _reference():
  return m.train_reference(m.awkward_loss, _TX(), m.awkward_params(),
                           m.awkward_batches(_STEPS))


def _ranges(x) -> list[tuple[int, int]]:
  """The memory ranges a jax or numpy array's data occupies."""
  if isinstance(x, jax.Array):
    return [(s.data.unsafe_buffer_pointer(),
             s.data.unsafe_buffer_pointer() + s.data.nbytes)
            for s in x.addressable_shards]
  start = x.__array_interface__["data"][0]
  return [(start, start + max(x.nbytes, 1))]


def _assert_intact(params: dict, before: dict, when: str) -> None:
  for name, x in params.items():
    if isinstance(x, jax.Array):
      assert not x.is_deleted(), f"the caller's {name} was deleted {when}"
    np.testing.assert_array_equal(np.asarray(x), before[name],
                                  err_msg=f"the caller's {name} {when}")


@pytest.mark.parametrize("stage,offload", [
    pytest.param(*c, marks=() if _default(*c) else pytest.mark.exhaustive)
    for c in _CASES])
def test_init_never_shares_or_donates_the_callers_buffers(stage, offload):
  config = {**_OFFLOADS, **_STAGE_3_OFFLOADS}[offload]
  mesh = zj.make_mesh(num_devices=8)
  engine = zj.Engine(m.awkward_loss, _TX(),
                     zj.ZeroConfig(stage=stage, min_shard_elements=0,
                                   **config), mesh)
  params = _callers_params(mesh)
  before = {k: np.array(v) for k, v in params.items()}
  state = engine.init(params)
  jax.block_until_ready(state)
  _assert_intact(params, before, "after init")
  theirs = [(name, r) for name, x in params.items() for r in _ranges(x)]
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    for a, b in _ranges(leaf):
      shared = [name for name, (c, d) in theirs if a < d and c < b]
      assert not shared, (f"state{jax.tree_util.keystr(path)} holds the "
                          f"caller's buffer of {shared}")
  state, losses = m.run_steps(engine, state, m.awkward_batches(_STEPS))
  jax.block_until_ready(state)
  _assert_intact(params, before, f"after {_STEPS} steps")
  ref_losses, ref_params = _reference()
  m.assert_matches(losses, engine.gather_params(state), ref_losses,
                   ref_params)


def test_the_default_run_covers_the_settings_pairwise():
  flags = [_flags(*c) for c in _CASES]
  assert not _shared.uncovered_pairs(
      flags, [_flags(*c) for c in _CASES if _default(*c)])
