"""ZeRO-Offload's split: the optimizer update as a program of its own on the
host's CPU devices (``ZeroConfig(update_on="host")``).

The fp32 master and the optimizer state live in host RAM as arrays on this
process's CPU devices, each leaf split over all of them, so that every CPU
device (XLA:CPU runs each on its own threads) updates its own part at the
speed of host memory. A step is two programs: the device's computes the
loss and gradients from the compute copy; this one reads the gradients,
takes their norm, checks and unscales them (float16), clips them, updates,
and casts the new master to the compute copy that goes back to the device.

The update is ``tx.update`` under ``jax.jit`` on global arrays, so any optax
chain is exact, global norms included: the layout decides only which CPU
device does which part.

In a multi-process run ``MirroredUpdate`` lays the state out on CPU devices
that mirror the mesh instead (``_mirror``): each process updates the
shards its own devices hold.

CPU devices are fixed when JAX starts: ``jax.config.update(
"jax_num_cpu_devices", os.cpu_count())`` before anything else touches JAX
gives one per core (the default on a GPU host is one). Where the mesh itself
is made of CPU devices (tests, CPU training), the update uses the CPU
devices the mesh leaves free, or all of them when it uses them all.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zero_jax.offload import _mirror

HOST_AXIS = "host"


def host_devices(mesh: Mesh) -> list:
  """This process's CPU devices that ``mesh`` does not use (all of them if
  it uses every one)."""
  cpus = jax.local_devices(backend="cpu")
  used = set(mesh.devices.flat)
  free = [d for d in cpus if d not in used]
  return free or cpus


def _spec(shape: tuple, k: int) -> P:
  """Split the first axis divisible by ``k`` (else the largest that is):
  each CPU device then updates a contiguous block where it can. Leaves with
  no such axis (scalars, odd sizes) are replicated."""
  axes = [a for a, d in enumerate(shape) if d % k == 0 and d >= k]
  if k == 1 or not axes:
    return P()
  axis = 0 if 0 in axes else max(axes, key=lambda a: shape[a])
  return P(*([None] * axis + [HOST_AXIS]))


class HostUpdate:
  """The optimizer update on the host's CPU devices.

  Args:
    tx: the optax transformation.
    master: the fp32 master as ``jax.ShapeDtypeStruct`` leaves (a tree).
    devices: the CPU devices to spread the state over.
  """

  def __init__(self, tx: optax.GradientTransformation, master: Any,
               devices: list):
    self.tx = tx
    self.mesh = Mesh(np.array(devices), (HOST_AXIS,))
    self.k = len(devices)
    self.master_shapes = master
    self.opt_shapes = jax.eval_shape(tx.init, master)
    self.master_shardings = self.shardings(master)
    self.opt_shardings = self.shardings(self.opt_shapes)
    self._jits = {}

  def sharding(self, shape: tuple) -> NamedSharding:
    """Where a leaf of this shape lives on the CPU devices."""
    return NamedSharding(self.mesh, _spec(tuple(shape), self.k))

  def shardings(self, tree: Any) -> Any:
    """The host sharding of every leaf of a tree of arrays or shapes."""
    return jax.tree.map(lambda x: self.sharding(x.shape), tree)

  def replicated_bytes(self, tree: Any) -> int:
    """Bytes of ``tree`` that every CPU device holds whole (no axis splits
    evenly); counted once."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)
               if self.k > 1 and _spec(tuple(x.shape), self.k) == P())

  def describe(self) -> str:
    """One line for ``Engine.describe()``."""
    whole = self.replicated_bytes(self.master_shapes) + self.replicated_bytes(
        self.opt_shapes)
    return (f"host update over {self.k} CPU device(s); "
            f"{whole / 2**20:.1f} MiB of state has no axis divisible by "
            f"{self.k} and is updated whole on each")

  def fits(self, tree: Any, dtype: Any) -> bool:
    """Whether ``tree`` can give its buffers to a compute copy in
    ``dtype``: the master's structure, shapes and layout, on these CPU
    devices, and not deleted."""
    leaves, want = jax.tree.leaves(tree), jax.tree.leaves(
        self.master_shardings)
    return (jax.tree.structure(tree) == jax.tree.structure(
        self.master_shardings) and all(
            isinstance(x, jax.Array) and not x.is_deleted() and
            x.dtype == jnp.dtype(dtype) and x.sharding == s and
            x.shape == m.shape for x, s, m in zip(
                leaves, want, jax.tree.leaves(self.master_shapes))))

  def put(self, tree: Any, shardings: Any = None) -> Any:
    """``tree`` copied onto the CPU devices (master layout by default)."""
    return jax.device_put(tree, shardings or self.master_shardings,
                          may_alias=False)

  def to_host(self, tree: Any, shardings: Any) -> Any:
    """``tree`` (from the mesh) moved to ``shardings`` on the CPU devices."""
    return jax.device_put(tree, shardings)

  def to_device(self, tree: Any, shardings: Any) -> Any:
    """``tree`` (from the CPU devices) moved to ``shardings`` on the mesh."""
    return jax.device_put(tree, shardings)

  def init(self, master: Any) -> Any:
    """``tx.init`` on the host-resident master."""
    return jax.jit(self.tx.init, out_shardings=self.opt_shardings)(master)

  def update(self, grads: Any, master: Any, opt_state: Any, extra: Any, *,
             prepare: Callable[..., tuple[Any, Any, Any]],
             compute_dtype: Any, into: Any = None
             ) -> tuple[Any, Any, Any, Any]:
    """One update. ``master``, ``opt_state`` and ``into`` are donated.

    Args:
      grads: the gradients as backward left them (on any devices, in any
        memory: copied here).
      master, opt_state: the host state.
      extra: small arrays ``prepare`` reads (copied here, replicated).
      prepare: ``prepare(grads, extra) -> (grads, finite, out)``, traced
        into the update: the gradients to apply (unscaled, clipped),
        whether to apply them (None: always; an overflow leaves master and
        optimizer state unchanged) and anything else to return.
      compute_dtype: the dtype of the compute copy returned.
      into: an earlier compute copy that nothing reads any more (on these
        CPU devices, in ``compute_dtype``), whose buffers the new one
        takes; None: fresh buffers.

    Returns:
      ``(master, opt_state, compute, out)``: the new host state, the new
      master cast to ``compute_dtype`` (on the CPU devices; the caller
      moves it to the device), and ``prepare``'s ``out``.
    """
    key = (prepare, jnp.dtype(compute_dtype), into is None)
    if key not in self._jits:
      # Every output takes a donated input's buffers: a fresh host buffer
      # costs a page fault per 4 KiB on first write (AdamW and its bf16
      # copy on 2 cores: 0.62 G params/s with a fresh copy, 0.89 without;
      # experiments/host_update_bench.py). ``keep_unused``: ``into`` is
      # never read, and
      # JAX would otherwise drop it, and its donation, from the program.
      self._jits[key] = jax.jit(
          functools.partial(self._update, prepare=prepare,
                            compute_dtype=key[1]),
          donate_argnums=(1, 2) if into is None else (1, 2, 4),
          keep_unused=True,
          out_shardings=(self.master_shardings, self.opt_shardings,
                         self.master_shardings, None))
    replicated = NamedSharding(self.mesh, P())
    grads = self.to_host(grads, self.master_shardings)
    extra = self.to_host(extra, jax.tree.map(lambda _: replicated, extra))
    return self._jits[key](grads, master, opt_state, extra, into)

  def _update(self, grads, master, opt_state, extra, into, *, prepare,
              compute_dtype):
    del into  # (only its buffers)
    # (16-bit gradients, ZeRO-Offload's transfer, widen exactly.)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    grads, finite, out = prepare(grads, extra)
    updates, new_opt = self.tx.update(grads, opt_state, master)
    new_master = optax.apply_updates(master, updates)
    if finite is not None:
      new_master, new_opt = jax.tree.map(
          lambda n, o: jnp.where(finite, n, o), (new_master, new_opt),
          (master, opt_state))
    compute = jax.tree.map(lambda x: x.astype(compute_dtype), new_master)
    return new_master, new_opt, compute, out


class MirroredUpdate(HostUpdate):
  """The host update of a multi-process run: the state laid out on CPU
  devices that mirror the mesh, ``c`` partners per device in the device's
  own process (``_mirror.partners``), each device's shards split among its
  partners, so that each process updates the shards its own devices hold
  on all its CPU devices, and nothing crosses between processes on its way
  to or from the host. (Only global reductions in the update, such as a
  gradient norm, run across processes.)

  Args:
    tx: the optax transformation.
    master: the fp32 master as ``jax.ShapeDtypeStruct`` leaves (a tree).
    mesh: the device mesh.
    master_specs, opt_specs: the ``PartitionSpec`` of each leaf of the
      master and of ``tx.init(master)`` on ``mesh``: the devices' ZeRO
      shards.
  """

  def __init__(self, tx: optax.GradientTransformation, master: Any,
               mesh: Mesh, master_specs: Any, opt_specs: Any):
    # (Not HostUpdate.__init__: the layout comes from the specs, not from
    # each leaf's shape alone.)
    self.tx = tx
    self.partner = _mirror.partners(mesh)
    self._device_of = {h: d for d, hs in self.partner.items() for h in hs}
    self.mesh = _mirror.mirror_mesh(mesh, self.partner, HOST_AXIS)
    self.k = self.mesh.size
    self.master_shapes = master
    self.opt_shapes = jax.eval_shape(tx.init, master)
    on = lambda spec, x: NamedSharding(self.mesh, _mirror.host_spec(
        spec, tuple(x.shape), self.mesh, HOST_AXIS))
    self.master_shardings = jax.tree.map(on, master_specs, master)
    self.opt_shardings = jax.tree.map(on, opt_specs, self.opt_shapes)
    self._jits = {}

  def replicated_bytes(self, tree: Any) -> int:
    """Bytes of ``tree`` (the master or the optimizer state, arrays or
    shapes) that each device's partners all hold whole (no dimension of
    its block divides among them); counted once."""
    if self.mesh.shape[HOST_AXIS] == 1:
      return 0
    shardings = {jax.tree.structure(self.master_shapes): self.master_shardings,
                 jax.tree.structure(self.opt_shapes): self.opt_shardings
                 }[jax.tree.structure(tree)]
    return sum(x.size * x.dtype.itemsize for x, s in zip(
        jax.tree.leaves(tree), jax.tree.leaves(shardings))
               if not any(HOST_AXIS in _mirror.spec_axes(e) for e in s.spec))

  def describe(self) -> str:
    whole = self.replicated_bytes(self.master_shapes) + self.replicated_bytes(
        self.opt_shapes)
    c = self.mesh.shape[HOST_AXIS]
    same = all(hs == (d,) for d, hs in self.partner.items())
    return (f"host update over {self.k} CPU devices in "
            f"{len({d.process_index for d in self.partner})} processes, "
            + ("the mesh's own" if same else f"{c} per device of the mesh, "
               "in its process") +
            ": each updates its device's shards; "
            f"{whole / 2**20:.1f} MiB of state has no dimension that "
            f"divides among a device's {c} and is updated whole on each")

  def put(self, tree: Any, shardings: Any = None) -> Any:
    return self.to_host(tree, shardings or self.master_shardings)

  def to_host(self, tree: Any, shardings: Any) -> Any:
    # Each partner's block copied from its device's shard, which holds it.
    across = lambda x, target: _mirror.local_put(x, target,
                                                 self._device_of.get)
    return jax.tree.map(lambda x, t: _move(x, t, across), tree, shardings)

  def to_device(self, tree: Any, shardings: Any) -> Any:
    def across(x, target):
      # Each device's block assembled from its partners' (a copy inside
      # each process), then, where the target holds more of the leaf than
      # a shard (a compute copy replicated over ``data``), gathered on the
      # mesh.
      blocks = NamedSharding(target.mesh,
                             _mirror.without(x.sharding.spec, HOST_AXIS),
                             memory_kind=target.memory_kind)
      return _reshard(_mirror.local_gather(x, blocks, self.partner.get),
                      target)
    return jax.tree.map(lambda x, t: _move(x, t, across), tree, shardings)


def _move(x: Any, target: NamedSharding,
          across: Callable[[jax.Array, NamedSharding], jax.Array]
          ) -> jax.Array:
  """``x`` laid out as ``target``: ``across`` between the mesh and its
  mirror."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    # Numpy, or this process's own array: the same value in every process
    # (as for any multi-process device_put).
    return jax.device_put(np.asarray(x), target)
  if x.sharding.device_set == target.device_set:
    return _reshard(x, target)
  return across(x, target)


def _reshard(x: jax.Array, target: NamedSharding) -> jax.Array:
  """``x`` laid out as ``target`` on the same devices."""
  if x.sharding.is_equivalent_to(target, x.ndim):
    return x
  return jax.jit(lambda a: a, out_shardings=target)(x)
