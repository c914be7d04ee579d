"""Checksums of a checkpoint's arrays, written at save, verified at restore.

Why. Orbax stores arrays as zstd-compressed zarr chunks without a checksum
of the data: one flipped bit in a chunk file restores, without an error, as
values off by up to 1e38. So ``Checkpointer`` records a checksum of every
array in the checkpoint's metadata (committed in the same atomic rename as
the arrays) and compares it with the restored arrays.

The checksum of an array of element bits ``b`` (as unsigned integers) is
two sums modulo 2**32: ``sum(b)`` and ``sum(b * i)``, ``i`` the element's
row-major index in the *whole* array. Addition modulo 2**32 does not depend
on order, so both are the same whichever sharding, mesh or offload holds
the array: a checkpoint restored into another stage or device count is
verified all the same. A flipped bit changes one element by ``±2**k``
(k < 32), hence the first sum: a single flip is always caught; the second
catches values that moved (a chunk read in another's place).

Where it is computed. Arrays in host memory (CPU devices, offloaded state)
are summed with numpy, shard by shard (``sum(b * i)`` from per-axis
marginal sums), with no compilation; arrays in accelerator memory by one
jitted program per state layout, a pass over device memory with no copy to
the host. Both give the same numbers.

On a mismatch, ``stored_files`` names the files that hold the leaf, read
from the OCDBT database orbax writes (``tensorstore.ocdbt.dump``, a public
API): the error names the step, the leaf and the file.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax._paths import key_name

# Recorded in the checkpoint's metadata beside the values, so that a later
# change of the algorithm is told apart from corruption.
ALGORITHM = "u32-sum-and-index-sum-v1"

# A device layout's checksum program, by its leaves' shapes and shardings.
_PROGRAMS: dict[Any, Any] = {}
_MASK = (1 << 32) - 1


def _unsigned(dtype: Any) -> tuple[Any, bool]:
  """The unsigned type of the same width, and whether elements are two
  32-bit words (64-bit types)."""
  size = np.dtype(dtype).itemsize
  if size == 8:
    return np.uint32, True
  return {1: np.uint8, 2: np.uint16, 4: np.uint32}[size], False


# ------------------------------------------------------------ host (numpy)


def _host_sums(bits: np.ndarray, start: tuple[int, ...],
               shape: tuple[int, ...]) -> tuple[int, int]:
  """``(sum(b), sum(b * i))`` modulo 2**32 of one block ``bits`` at
  ``start`` of an array of ``shape`` (``i``: the global row-major index;
  ``sum(b * i) = sum_d stride_d (start_d sum(b) + sum_j m_d[j] j)``, with
  ``m_d`` the block's sums over every axis but ``d``). Numpy's uint32
  sums wrap modulo 2**32, which is the arithmetic wanted, at full speed."""
  u32 = np.uint32
  if bits.ndim == 0:
    return int(bits) & _MASK, 0
  marginals = [bits.sum(axis=tuple(a for a in range(bits.ndim) if a != d),
                        dtype=u32) for d in range(bits.ndim)]
  total = int(marginals[-1].sum(dtype=u32))
  weighted = 0
  stride = 1
  for d in reversed(range(bits.ndim)):
    j = np.arange(bits.shape[d], dtype=u32)
    along = int((marginals[d] * j).sum(dtype=u32))
    weighted += stride * (start[d] * total + along)
    stride *= shape[d]
  return total, weighted & _MASK


def _host_checksum(x: Any) -> tuple[int, int]:
  """This process's part of an array's sums, from its shards in host
  memory (one replica of each)."""
  dtype = x.dtype
  if jnp.issubdtype(dtype, jax.dtypes.prng_key):
    return _host_checksum(jax.random.key_data(x))
  unsigned, pair = _unsigned(dtype)
  shape = tuple(x.shape) + ((2,) if pair else ())
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    # (One block: assembling it is a copy in host memory, cheaper than
    # summing many small shards one by one.)
    blocks = [(np.asarray(x), (0,) * np.ndim(x))]
  else:
    blocks = [(np.asarray(s.data), tuple(i.start or 0 for i in s.index))
              for s in x.addressable_shards if s.replica_id == 0]
  total = weighted = 0
  for block, start in blocks:
    # (Not ascontiguousarray: it makes scalars 1-d.)
    bits = np.array(block, copy=not block.flags.c_contiguous).view(unsigned)
    if pair:
      bits = bits.reshape(block.shape + (2,))
      start = start + (0,)
    t, w = _host_sums(bits, start, shape)
    total, weighted = total + t, weighted + w
  return total & _MASK, weighted & _MASK


# ------------------------------------------------------- device (jitted)


def _device_sums(x: jax.Array) -> jax.Array:
  """``[sum(b), sum(b * i)]`` modulo 2**32 (uint32 arithmetic wraps)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)  # (the same bits as numpy's view)
  unsigned, _ = _unsigned(x.dtype)
  bits = jax.lax.bitcast_convert_type(x, jnp.dtype(unsigned))
  bits = bits.astype(jnp.uint32)  # (64-bit: a trailing axis of 2 words)
  index = jnp.zeros(bits.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(bits.ndim)):
    iota = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
    index = index + iota * jnp.uint32(stride & _MASK)
    stride *= bits.shape[axis]
  return jnp.stack([jnp.sum(bits, dtype=jnp.uint32),
                    jnp.sum(bits * index, dtype=jnp.uint32)])


def _in_host_memory(x: Any) -> bool:
  if not isinstance(x, jax.Array):
    return True
  sharding = x.sharding
  kind = getattr(sharding, "memory_kind", None)
  return (next(iter(sharding.device_set)).platform == "cpu" or
          (kind is not None and "host" in kind))


def _program(leaves: list[jax.Array]) -> Any:
  """The jitted sums of these leaves (kept per layout: a training loop
  saves the same layout again and again)."""
  key = tuple((x.shape, str(x.dtype), x.sharding) for x in leaves)
  program = _PROGRAMS.get(key)
  if program is None:
    if len(_PROGRAMS) > 16:  # (bounded: layouts come and go in a process)
      _PROGRAMS.clear()
    program = _PROGRAMS[key] = jax.jit(
        lambda xs: [_device_sums(x) for x in xs])
  return program


# ----------------------------------------------------------------- public


def checksums(tree: Any) -> dict[str, int]:
  """Every array leaf's checksum, by its name in orbax's files.

  What ``Checkpointer`` records at save and verifies at restore. Every
  process of a multi-process run must call it together.

  Args:
    tree: a pytree of ``jax.Array`` s (any sharding, devices or memory)
      or numpy arrays.

  Returns:
    ``{name: checksum}``, named as orbax names the leaf in its files
    (``opt_state.0.mu.w``: ``leaf_name``); the same for the same values
    under any sharding, mesh or memory.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  names = [leaf_name(p) for p, _ in flat]
  sums: dict[int, tuple[int, int]] = {}
  on_device = [i for i, (_, x) in enumerate(flat)
               if not _in_host_memory(x)]
  for i, (_, x) in enumerate(flat):
    if i not in on_device:
      sums[i] = _host_checksum(x)
  if jax.process_count() > 1 and sums:
    # (Each process summed its own shards: add the parts up.)
    # pylint: disable-next=g-import-not-at-top
    from jax.experimental import multihost_utils
    keys = sorted(sums)
    parts = np.asarray(multihost_utils.process_allgather(np.array(
        [[t & _MASK, w & _MASK] for t, w in (sums[k] for k in keys)],
        np.uint32)))
    total = parts.reshape(-1, len(keys), 2).sum(axis=0, dtype=np.uint64)
    sums = {k: (int(t) & _MASK, int(w) & _MASK)
            for k, (t, w) in zip(keys, total)}
  if on_device:
    found = checksums_on_device([flat[i][1] for i in on_device])
    for i, value in zip(on_device, found):
      sums[i] = (value >> 32, value & _MASK)
  return {names[i]: (t << 32) | w for i, (t, w) in sorted(sums.items())}


def checksums_on_device(leaves: list[jax.Array]) -> list[int]:
  """The checksums of ``leaves`` by the jitted program, wherever they are
  (what ``checksums`` does for arrays in accelerator memory)."""
  out = []
  for pair in _program(leaves)(leaves):
    t, w = np.asarray(pair.addressable_data(0)).tolist()
    out.append((int(t) << 32) | int(w))
  return out


def mismatches(recorded: dict[str, int], found: dict[str, int]) -> list[str]:
  """The key paths whose checksum differs (or is missing) between what was
  recorded at save and what was restored."""
  return [name for name, value in recorded.items()
          if found.get(name) != value]


def leaf_name(path: tuple) -> str:
  """Orbax's name of the leaf at ``path`` in its files: the keys joined by
  dots (``{'a': [x]}`` -> ``a.0``)."""
  return ".".join(key_name(k) for k in path)


def stored_files(item_dir: str, name: str) -> list[str]:
  """The files under ``item_dir`` (an orbax item, e.g. ``<step>/state``)
  that hold leaf ``name`` (``leaf_name``), read from its OCDBT database;
  empty where that cannot be read (then the item directory is the place to
  look)."""
  try:
    import tensorstore as ts  # pylint: disable=g-import-not-at-top
    base = ts.KvStore.open({"driver": "file",
                            "path": item_dir.rstrip("/") + "/"}).result()
    manifest = ts.ocdbt.dump(base).result()
    roots = [v["root"]["location"] for v in manifest.get("versions", [])
             if v.get("root", {}).get("location")]
    files: set[str] = set()
    prefix = (name + "/").encode()
    pending = roots[-1:]
    while pending:
      location = pending.pop()
      node = ts.ocdbt.dump(base, location).result()
      for entry in node.get("entries", []):
        # (Inner nodes' entries point at child nodes; leaves' at values,
        # inline in the node's own file or indirect in a data file.)
        children = [v for v in entry.values() if isinstance(v, str)
                    and v.startswith("btreenode:")]
        if children:
          pending.extend(children)
          continue
        key = entry.get("key", b"")
        key = key if isinstance(key, bytes) else str(key).encode()
        if key.startswith(prefix):
          files.add(_file_of(entry.get("indirect_value") or location))
    return sorted(f for f in files if f)
  except Exception:  # pylint: disable=broad-except
    return []  # (best effort: only the error message is less precise)


def _file_of(location: str) -> str:
  """The file of an OCDBT location, ``<kind>:<base>:<path>:<offset>:<size>``
  (``value:ocdbt.process_0/:d/ab12:0:9`` -> ``ocdbt.process_0/d/ab12``)."""
  where = location.split(":", 1)[-1].rsplit(":", 2)[0]
  return where.replace(":", "", 1)
