"""The fused host optimizer in a multi-process run: each process updates the
shards its own devices hold, in host buffers it owns.

The state is laid out as ``MirroredUpdate`` lays it out (each device's
ZeRO shards on CPU devices of its own process, ``_mirror``), but every
shard is a page-aligned numpy buffer of this module's, and the state's
leaves are global arrays whose shards *are* those buffers (JAX's CPU
devices take an aligned numpy array as their buffer without a copy;
checked, never assumed). Checkpoints, exports and restores then see
ordinary global arrays, each process writing and reading its own shards,
while the kernels update the buffers in place: each step wraps them in new
arrays and deletes the old ones, so a state given to an earlier step is
refused as a donated one is.

The global norm's sum of squares adds each process's (every shard once:
replicas are skipped) across processes; everything else is local.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from zero_jax.offload import _mirror
from zero_jax.offload._buffers import owned
from zero_jax.offload._fused import FusedUpdate
from zero_jax.offload._host import MirroredUpdate
from zero_jax.offload._optimizers import HostRule


def _devices(shape: tuple, sharding: Any) -> list:
  """This process's devices of ``sharding``, in the order blocks are kept."""
  return list(sharding.addressable_devices_indices_map(tuple(shape)))


def _box(index: tuple, shape: tuple) -> tuple:
  """A shard's index as (start, stop) per dimension."""
  return tuple(i.indices(n)[:2] for i, n in zip(index, shape))


def _wrap(blocks: list[np.ndarray], shape: tuple, sharding: Any
          ) -> jax.Array:
  """A global array of ``shape`` on ``sharding`` whose shards are
  ``blocks`` (in ``_devices`` order), not copies of them."""
  shards = [jax.device_put(b, d) for b, d in
            zip(blocks, _devices(shape, sharding))]
  for b, x in zip(blocks, shards):
    if x.unsafe_buffer_pointer() != b.ctypes.data:
      raise RuntimeError(
          "JAX copied a host buffer of the fused host optimizer instead of "
          "taking it as the CPU device's buffer, so its updates would not "
          "reach the state; build the optimizer with optax itself (the "
          "update then runs as an XLA:CPU program)")
  return jax.make_array_from_single_device_arrays(tuple(shape), sharding,
                                                  shards)


def _fresh(x: jax.Array) -> jax.Array:
  """``x`` with buffers of its own (a copy of each shard)."""
  return jax.make_array_from_single_device_arrays(
      x.shape, x.sharding, [jax.device_put(np.array(s.data), s.device)
                            for s in x.addressable_shards])


class MirroredFused(FusedUpdate):
  """The fused host optimizer of a multi-process run.

  Args:
    tx: an optimizer the fused host optimizer runs.
    rule: its rule.
    master: the fp32 master as ``jax.ShapeDtypeStruct`` leaves.
    mesh: the device mesh.
    master_specs, opt_specs: as ``MirroredUpdate``'s.
  """

  def __init__(self, tx: optax.GradientTransformation, rule: HostRule,
               master: Any, mesh: Mesh, master_specs: Any, opt_specs: Any):
    super().__init__(tx, rule, master, jax.local_devices(backend="cpu")[0])
    self.mirror = MirroredUpdate(tx, master, mesh, master_specs, opt_specs)
    self.master_shardings = self.mirror.master_shardings
    self.opt_shardings = self.mirror.opt_shardings
    self._device_of = {h: d for d, hs in self.mirror.partner.items()
                       for h in hs}
    # Per master leaf, (its shape, its sharding): read per leaf each step.
    self._leaves = list(zip(jax.tree.leaves(master),
                            jax.tree.leaves(self.master_shardings)))
    # Per master leaf and block: whether it counts in the norm (the first
    # device in the mesh's order holding that block: replicas count once).
    self._first = []
    for x, m in zip(jax.tree.leaves(master),
                    jax.tree.leaves(self.master_shardings)):
      first = {}
      for d, index in m.devices_indices_map(x.shape).items():
        first.setdefault(_box(index, x.shape), d)
      self._first.append([
          first[_box(index, x.shape)] is d for d, index in
          m.addressable_devices_indices_map(x.shape).items()])
    # id(leaf) -> (leaf, its blocks): the live state's leaves.
    self._owned: dict[int, tuple[jax.Array, list[np.ndarray]]] = {}

  def owns(self, x: Any) -> bool:
    held = self._owned.get(id(x))
    return held is not None and held[0] is x

  def _blocks(self, tree: Any) -> list[list[np.ndarray]]:
    out = []
    for x in jax.tree.leaves(tree):
      if not self.owns(x):
        raise ValueError(
            "this state's host arrays are not the fused host optimizer's "
            "live state: pass the TrainState the last engine.step returned")
      out.append(self._owned[id(x)][1])
    return out

  def _grad_blocks(self, grads: Any) -> Iterator[list[np.ndarray]]:
    leaves = jax.tree.leaves(grads)
    # Each device's shard (index, data), its copy to the host started.
    shards = [{s.device: (s.index, s.data) for s in g.addressable_shards}
              for g in leaves]
    for by_device in shards:
      for _, data in by_device.values():
        data.copy_to_host_async()
    for g, m, by_device in zip(leaves, jax.tree.leaves(self.master_shardings),
                               shards):
      whole = {}  # (each device's shard copied to the host once)
      blocks = []
      for h, index in m.addressable_devices_indices_map(g.shape).items():
        d = self._device_of[h]
        src_index, data = by_device[d]
        if d not in whole:
          whole[d] = np.asarray(data)
        rel = _mirror.within(src_index, index, g.shape)
        blocks.append(np.ascontiguousarray(
            whole[d] if rel is None else whole[d][rel]))
      yield blocks

  def _counted(self, j: int, b: int) -> bool:
    return self._first[j][b]

  def _total(self, sumsq: float) -> float:
    # pylint: disable-next=g-import-not-at-top
    from jax.experimental import multihost_utils
    return float(np.sum(multihost_utils.process_allgather(
        np.array([sumsq], np.float64))))

  def _block_shapes(self) -> list[list[tuple]]:
    return [[tuple(hi - lo for lo, hi in _box(index, x.shape))
             for index in m.addressable_devices_indices_map(x.shape).values()]
            for x, m in zip(jax.tree.leaves(self.master_shapes),
                            jax.tree.leaves(self.master_shardings))]

  def _leaf(self, j: int, blocks: list[np.ndarray]) -> Any:
    return _wrap(blocks, self._leaves[j][0].shape, self._leaves[j][1])

  def _own(self, pairs: list[tuple[Any, list[np.ndarray]]], tree: Any
           ) -> Any:
    """``tree``'s leaves wrapped anew over their blocks, now the live
    state."""
    out, self._owned = [], {}
    for x, blocks in pairs:
      y = _wrap(blocks, x.shape, x.sharding)
      self._owned[id(y)] = (y, blocks)
      out.append(y)
    return jax.tree.unflatten(jax.tree.structure(tree), out)

  def _publish(self, master: Any, opt_state: Any, updated: bool = False
               ) -> tuple[Any, Any]:
    del updated
    leaves = jax.tree.leaves((master, opt_state))
    pairs = [(x, self._owned[id(x)][1]) for x in leaves]
    out = self._own(pairs, (master, opt_state))
    for x in leaves:
      x.delete()  # (the buffers stay: they are this updater's)
    return out

  def adopt(self, master: Any, opt_state: Any, commit: Any = None
            ) -> tuple[Any, Any]:
    """Master and optimizer state (global arrays on this layout: a
    restore's, an init's) copied into host buffers, shard by shard."""
    del commit
    self.wait()
    pairs = []
    for x, dtype in [(x, np.float32) for x in jax.tree.leaves(master)] + [
        (x, None) for x in jax.tree.leaves(opt_state)]:
      shards = {s.device: s for s in x.addressable_shards}
      pairs.append((x, [owned(shards[d].data, dtype)
                        for d in _devices(x.shape, x.sharding)]))
    return self._own(pairs, (master, opt_state))

  def put(self, tree: Any, shardings: Any = None) -> Any:
    return self.mirror.put(tree, shardings)

  def init(self, master: Any, commit: Any = None) -> tuple[Any, Any]:
    del commit
    master = self.mirror.put(master)
    return self.adopt(master, self.mirror.init(jax.tree.map(
        lambda x: x.astype(np.float32), master)))

  @staticmethod
  def _detached(x: Any) -> Any:
    return _fresh(x)

  def _put(self, tree: Any, shardings: Any) -> Any:
    return self.mirror.to_device(tree, shardings)

  def host_bytes(self, copy_dtype: Any, grad_dtype: Any,
                 background: bool = False) -> int:
    """This process's share of ``FusedUpdate.host_bytes``."""
    mine = sum(math.prod(b) for shapes in self._block_shapes()
               for b in shapes)
    whole = sum(x.size for x in jax.tree.leaves(self.master_shapes))
    return super().host_bytes(copy_dtype, grad_dtype,
                              background) * mine // whole

  def describe(self) -> str:
    return (super().describe() + f"; in {jax.process_count()} processes, "
            "each updating the shards its own devices hold")

