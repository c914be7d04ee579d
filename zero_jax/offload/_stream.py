"""The streamed update: offloaded state passes through the device a slice at
a time.

With ``offload_optimizer`` (or ``offload_params``) the fp32 master and the
optimizer state live in pinned host memory. Copying them whole to the device
for the update would put them all in device memory at once: XLA starts every
copy early, and donation never aliases across memory kinds. Instead each
large leaf is cut along its first axis (the layer axis of a stacked leaf;
rows of a matrix) into ``k`` slices, and a ``lax.scan`` over the slices
copies one slice of master and moments to the device, runs ``tx.update`` on
it and writes it back; XLA's host offloader turns the scan's dynamic slices
of host arrays into one asynchronous copy per slice. Leaves that cannot be
cut are updated whole, one group at a time.

Cutting is exact only for updates that keep rows apart; ``separable``
proves that from the traced update. Leaves whose rows an update mixes
(adafactor's per-leaf RMS clipping) are updated whole; an update that mixes
leaves (``clip_by_global_norm`` in the chain) is an error naming
``ZeroConfig.clip_grad_norm``. Shared scalars (Adam's count) come from the
first call only, so they advance once per step.

A leaf sharded on its first axis is cut inside each device's block of rows,
so a slice holds the same rows on every device and no slice moves between
devices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zero_jax.offload import _separable as separable
from zero_jax._paths import path_str
from zero_jax.layout import LeafPlan

# State bytes per device (master, gradient and optimizer state) that one
# slice of a leaf may hold: large enough that a GPU copy runs near PCIe
# speed, small enough that a few slices in flight are a small part of memory.
SLICE_BYTES = 64 << 20
# Bytes per parameter element a slice budget counts: master, gradient and
# two moments in float32.
_STATE_BYTES = 16


@dataclasses.dataclass(frozen=True)
class _Cut:
  """A leaf cut into ``k`` slices along its first axis; ``blocks`` is the
  number of devices the first axis is sharded over (1 if it is not), and
  each device's block of rows is cut alike."""

  blocks: int
  k: int

  def view(self, x):
    return x.reshape(self.blocks, self.k, -1, *x.shape[1:])

  def take(self, v, i):
    s = jax.lax.dynamic_index_in_dim(v, i, 1, keepdims=False)
    return s.reshape(-1, *s.shape[2:])

  def put(self, v, s, i):
    s = s.reshape(self.blocks, -1, *s.shape[1:])
    return jax.lax.dynamic_update_index_in_dim(v, s, i, 1)

  def shape(self, shape):
    return (shape[0] // self.k, *shape[1:])


def _to_device(x):
  return jax.device_put(x, jax.memory.Space.Device)


def _to_host(x):
  return jax.device_put(x, jax.memory.Space.Host)


def _blocks(lp: LeafPlan, n: int) -> int:
  return n if lp.dim == 0 else 1


def _smallest_divisor_at_least(e: int, k: int) -> int:
  return next((d for d in range(max(k, 1), e + 1) if e % d == 0), e)


def _owner(path: tuple, shape: tuple, param_paths: list[tuple],
           param_shapes: list[tuple]) -> int | None:
  """The parameter whose path is the longest suffix of an optimizer-state
  leaf's path (optax mirrors the parameter tree inside its states). A
  scalar belongs to no array parameter: ``inject_hyperparams``' ``b1`` is
  not the parameter named ``b1``."""
  best, best_len = None, -1
  for i, (pp, ps) in enumerate(zip(param_paths, param_shapes)):
    if not shape and ps:
      continue
    if len(pp) <= len(path) and tuple(path[len(path) - len(pp):]) == pp:
      if len(pp) > best_len:
        best, best_len = i, len(pp)
  return best


class Streamer:
  """How one engine's offloaded update is cut into slices.

  Args:
    tx: the optax transformation.
    master: the fp32 master parameters (shapes suffice), global shapes.
    param_plans: the ``LeafPlan`` of every master leaf, flattened.
    opt_plans: the ``LeafPlan`` of every optimizer-state leaf, flattened.
    n: devices on the ``data`` axis.
    slice_bytes: state bytes per device a slice may hold.

  Raises:
    ValueError: ``tx`` combines different parameters (a global norm), so
      no slicing is exact.
  """

  def __init__(self, tx: optax.GradientTransformation, master: Any,
               param_plans: list[LeafPlan], opt_plans: list[LeafPlan],
               n: int, slice_bytes: int = SLICE_BYTES):
    self.tx = tx
    flat, self.treedef = jax.tree_util.tree_flatten_with_path(master)
    self.paths = [path_str(p) for p, _ in flat]
    self.shapes = [tuple(x.shape) for _, x in flat]
    opt_full = jax.eval_shape(tx.init, master)
    oflat, self.opt_treedef = jax.tree_util.tree_flatten_with_path(opt_full)
    self.opt_shapes = [tuple(x.shape) for _, x in oflat]
    self.opt_dtypes = [x.dtype for _, x in oflat]
    param_paths = [tuple(p) for p, _ in flat]
    self.owner = [_owner(tuple(p), tuple(x.shape), param_paths, self.shapes)
                  for p, x in oflat]
    self.opt_paths = [path_str(p) for p, _ in oflat]

    # Leaves with the same number of rows are cut alike and share one scan,
    # so that one iteration holds at most slice_bytes of all of them; where
    # even one row of each is more than that, each leaf gets its own scan.
    local = [math.prod(lp.local_shape(n)) * _STATE_BYTES
             for lp in param_plans]
    by_rows: dict[int, list[int]] = {}
    for l, (shape, lp) in enumerate(zip(self.shapes, param_plans)):
      if shape and shape[0] // _blocks(lp, n) >= 2:
        by_rows.setdefault(shape[0] // _blocks(lp, n), []).append(l)
    cuts: dict[int, _Cut] = {}
    scan_of: dict[int, tuple] = {}
    for rows, same in sorted(by_rows.items()):
      need = -(-sum(local[l] for l in same) // slice_bytes)
      if need <= rows:
        parts = [(same, need)]
      else:
        parts = [([l], -(-local[l] // slice_bytes)) for l in same]
      for ls, need in parts:
        if need < 2:
          continue
        k = _smallest_divisor_at_least(rows, need)
        for l in ls:
          cuts[l] = _Cut(_blocks(param_plans[l], n), k)
          scan_of[l] = (rows, ls[0])
    self._opt_blocks = [_blocks(lp, n) for lp in opt_plans]
    # Cut leaves whose rows the update (or init) mixes are updated whole;
    # drop them and look again until nothing changes.
    while True:
      self.opt_cuts, dropped = self._opt_cuts(cuts)
      if not dropped:
        dropped = self._check(cuts)
      if not dropped:
        break
      for l in dropped:
        del cuts[l]
    self.cuts = cuts
    # Calls: the scans, then the uncut leaves, grouped up to
    # the slice budget (a leaf larger than that alone).
    scans: dict[tuple, list[int]] = {}
    for l in sorted(cuts):
      scans.setdefault(scan_of[l], []).append(l)
    self.calls: list[tuple[int, list[int]]] = [
        (cuts[ls[0]].k, ls) for _, ls in sorted(scans.items())]
    group, size = [], 0
    for l, (shape, lp) in enumerate(zip(self.shapes, param_plans)):
      if l in cuts:
        continue
      b = local[l]
      if group and size + b > slice_bytes:
        self.calls.append((1, group))
        group, size = [], 0
      group.append(l)
      size += b
    if group:
      self.calls.append((1, group))

  # ----------------------------------------------------------- analysis

  def _view(self, cuts, members=None):
    """Master shapes as one call sees them: cut leaves a slice, uncut ones
    whole, leaves outside ``members`` empty placeholders."""
    def shape(l):
      s = self.shapes[l]
      if members is not None and l not in members:
        return (0, *s[1:]) if s else s
      return cuts[l].shape(s) if l in cuts else s
    return self.treedef.unflatten(
        [jax.ShapeDtypeStruct(shape(l), jnp.float32)
         for l in range(len(self.shapes))])

  def _opt_cuts(self, cuts):
    """How each optimizer-state leaf is cut (None: passed whole), and the
    leaves whose state does not cut like the leaf."""
    view = jax.tree.leaves(jax.eval_shape(self.tx.init, self._view(cuts)))
    out, dropped = [], set()
    for j, (full, v) in enumerate(zip(self.opt_shapes, view)):
      l = self.owner[j]
      if tuple(v.shape) == full:
        out.append(None)
        continue
      if l is None:
        raise ValueError(
            f"optimizer state {self.opt_paths[j]!r} {full} changes shape "
            "with the parameters but belongs to none of them; the streamed "
            "offload update cannot slice it. Set offload_optimizer=None.")
      c = cuts.get(l)
      ok = (c is not None and len(v.shape) == len(full) and full
            and full[1:] == tuple(v.shape[1:])
            and full[0] == v.shape[0] * c.k and full[0] == self.shapes[l][0]
            and self._opt_blocks[j] == c.blocks)
      if not ok:
        dropped.add(l)
      out.append(c if ok else None)
    return out, dropped

  def _check(self, cuts) -> set[int]:
    """Runs ``separable`` on update and init; returns leaves to uncut."""
    tag = separable.Tag
    ptags = self.treedef.unflatten(
        [tag({l: 0 if l in cuts else None}) for l in range(len(self.shapes))])
    otags = self.opt_treedef.unflatten(
        [tag() if l is None else
         tag({l: 0 if c is not None else None})
         for l, c in zip(self.owner, self.opt_cuts)])
    view = self._view(cuts)
    opt_view = jax.eval_shape(self.tx.init, view)
    update = separable.analyze(self.tx.update, (view, opt_view, view),
                               (ptags, otags, ptags))
    init = separable.analyze(self.tx.init, (view,), (ptags,))
    for report in (update, init):
      if report.cross:
        prim, leaves = report.cross[0]
        names = ", ".join(repr(self.paths[l]) for l in sorted(leaves)[:3])
        raise ValueError(
            f"the optimizer combines different parameters ({names} meet in "
            f"a {prim!r}), e.g. optax.clip_by_global_norm in the chain: the "
            "streamed offload update runs slice by slice and cannot split "
            "it. Clip with ZeroConfig(clip_grad_norm=...) instead (exact "
            "over all shards, before the update), or set update_on='host' or "
            "offload_optimizer=None.")
    n_up = self.treedef.num_leaves
    out_opt = update.out[n_up:]
    shared = [j for j, l in enumerate(self.owner) if l is None and out_opt[j]]
    if shared:
      j = shared[0]
      raise ValueError(
          f"optimizer state {self.opt_paths[j]!r} depends on the parameters "
          "as a whole: the streamed offload update cannot split it. Set "
          "update_on='host' or offload_optimizer=None.")
    return (update.lost | init.lost) & set(cuts)

  # -------------------------------------------------------------- running

  def describe(self) -> list[str]:
    lines = []
    for k, members in self.calls:
      names = ", ".join(self.paths[l] for l in members[:4])
      names += ", ..." if len(members) > 4 else ""
      lines.append(f"  {k} slice(s): {len(members)} leaf(s) [{names}]")
    return lines

  def _call_view(self, members):
    """Optimizer-state shapes of one call (placeholders for the rest)."""
    return [tuple(x.shape) for x in jax.tree.leaves(
        jax.eval_shape(self.tx.init, self._view(self.cuts, set(members))))]

  def update(self, grads: Any, opt_state: Any, master: Any, *,
             finite: jax.Array | None, master_on_host: bool,
             opt_on_host: bool, compute_dtype: Any = None,
             compute: list | None = None, grad_fn=None):
    """The optax update, streamed.

    Args:
      grads: gradients, global arrays in the master's layout (device).
      opt_state: the optimizer state (host or device memory).
      master: the fp32 master (host or device memory), sharded layout.
      finite: a flag; where False the old state is kept (float16 skips).
      master_on_host: ``master`` lives (and stays) in host memory.
      opt_on_host: ``opt_state`` lives (and stays) in host memory.
      compute_dtype: also return the new master cast to this dtype, in
        device memory, written slice by slice (for the next forward).
      compute: flat initial buffers for that copy (device, master layout).
      grad_fn: applied to each gradient slice on the device before the
        update (unscaling and clipping of gradients kept in host memory).

    Returns:
      ``(master, opt_state, compute)``: compute is a flat list or None.
    """
    def update(gs, ps, os_):
      if grad_fn is not None:
        gs = jax.tree.map(grad_fn, gs)
      updates, new_o = self.tx.update(gs, os_, ps)
      new_p = optax.apply_updates(ps, updates)
      if finite is None:
        return new_p, new_o
      keep = lambda new, old: jax.tree.map(
          lambda a, b: jnp.where(finite, a, b), new, old)
      return keep(new_p, ps), keep(new_o, os_)

    p = jax.tree.leaves(master)
    p, o, comp = self._drive(update, jax.tree.leaves(grads), p, p,
                             jax.tree.leaves(opt_state), master_on_host,
                             opt_on_host, compute_dtype, compute)
    return (self.treedef.unflatten(p), self.opt_treedef.unflatten(o), comp)

  def grad_stats(self, grads: Any, fn) -> tuple[jax.Array, jax.Array]:
    """The global norm of ``fn(grads)`` and whether it is all finite, read
    a slice at a time (for gradients in host memory)."""
    g = jax.tree.leaves(grads)

    def stats(x):
      x = fn(_to_device(x)).astype(jnp.float32)
      return jnp.sum(x * x), jnp.all(jnp.isfinite(x))

    total = (jnp.zeros((), jnp.float32), jnp.array(True))
    add = lambda a, b: (a[0] + b[0], jnp.logical_and(a[1], b[1]))
    for k, members in self.calls:
      if k == 1:
        for l in members:
          total = add(total, stats(g[l]))
        continue
      views = {l: self.cuts[l].view(g[l]) for l in members}

      def body(acc, i, members=members, views=views):
        for l in members:
          acc = add(acc, stats(self.cuts[l].take(views[l], i)))
        return acc, None

      part, _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32),
                                    jnp.array(True)), jnp.arange(k))
      total = add(total, part)
    return jnp.sqrt(total[0]), total[1]

  def init(self, params: list, master: list, opt_state: list, *,
           master_on_host: bool, opt_on_host: bool, compute_dtype: Any = None,
           compute: list | None = None):
    """``tx.init``, streamed: the state is built a slice at a time.

    Args:
      params: the caller's parameters, flat, placed in the master's layout
        and memory (any floating dtype).
      master: flat fp32 buffers to write the master into; an entry may be
        the ``params`` entry itself where that is already float32.
      opt_state: flat buffers (zeros) in the optimizer state's layout and
        memory, written slice by slice.
      master_on_host, opt_on_host, compute_dtype, compute: as in ``update``.

    Returns:
      ``(master, opt_state, compute)`` as trees (compute: flat or None).
    """
    def init(gs, ps, os_):
      del gs, os_
      return ps, self.tx.init(ps)

    p, o, comp = self._drive(init, None, params, master, opt_state,
                             master_on_host, opt_on_host, compute_dtype,
                             compute)
    return (self.treedef.unflatten(p), self.opt_treedef.unflatten(o), comp)

  def _drive(self, fn, g, p_read, p, o, master_on_host, opt_on_host,
             compute_dtype, compute):
    """Runs ``fn(grads, master, opt_state) -> (master, opt_state)`` (trees
    of device slices) over every call, reading ``p_read`` and writing the
    new master into ``p`` (in place where they are the same array)."""
    p, o = list(p), list(o)
    o_old = list(o)
    cast = compute_dtype is not None
    comp = list(compute) if cast else None
    put_p = _to_host if master_on_host else (lambda x: x)
    put_o = _to_host if opt_on_host else (lambda x: x)
    f32 = lambda x: _to_device(x).astype(jnp.float32)
    token: tuple = ()
    shared_done = False

    for k, members in self.calls:
      mset = set(members)
      opt_view = self._call_view(members)
      # Shared leaves (Adam's count) are read by every call, but only the
      # first call's result is kept.
      oj = [j for j in range(len(o))
            if self.owner[j] in mset or self.owner[j] is None]
      in_place = {l: p[l] is p_read[l] for l in members}
      # What this call reads, tied to what the previous call wrote, so that
      # calls run one after another and their copies do not pile up.
      reads = ([g[l] for l in members] if g is not None else [],
               [p_read[l] for l in members], [p[l] for l in members],
               [o_old[j] if self.owner[j] is None else o[j] for j in oj])
      if token:
        token, reads = jax.lax.optimization_barrier((token, reads))
      gl = dict(zip(members, reads[0])) if g is not None else {}
      rl = dict(zip(members, reads[1]))
      pl = dict(zip(members, reads[2]))
      pl = {l: pl[l] if not in_place[l] else rl[l] for l in members}
      ol = dict(zip(oj, reads[3]))
      sliced_o = [j for j in oj if self.opt_cuts[j] is not None]
      whole_o = [j for j in oj if self.opt_cuts[j] is None]
      keep_shared = not shared_done

      def one(gs, ps, os_):
        """``fn`` on one slice; dicts by leaf / opt index of device
        arrays; other leaves are empty placeholders."""
        zero = lambda s, dt=jnp.float32: jnp.zeros(
            (0, *s[1:]) if s else s, dt)
        pi = [ps[l] if l in mset else zero(s)
              for l, s in enumerate(self.shapes)]
        gi = [gs[l] if l in gs else zero(s)
              for l, s in enumerate(self.shapes)]
        oi = [os_[j] if j in os_ else jnp.zeros(shape, self.opt_dtypes[j])
              for j, shape in enumerate(opt_view)]
        new_p, new_o = fn(self.treedef.unflatten(gi),
                          self.treedef.unflatten(pi),
                          self.opt_treedef.unflatten(oi))
        new_p, new_o = jax.tree.leaves(new_p), jax.tree.leaves(new_o)
        return ({l: new_p[l] for l in mset}, {j: new_o[j] for j in oj})

      if k == 1:
        new_p, new_o = one({l: _to_device(x) for l, x in gl.items()},
                           {l: f32(rl[l]) for l in members},
                           {j: _to_device(ol[j]) for j in oj})
        out_p = {l: put_p(new_p[l]) for l in members}
        out_o = {j: put_o(new_o[j]) for j in oj}
        out_c = ({l: new_p[l].astype(compute_dtype) for l in members}
                 if cast else {})
      else:
        cut = {l: self.cuts[l] for l in members}
        ocut = {j: self.opt_cuts[j] for j in sliced_o}
        gv = {l: cut[l].view(gl[l]) for l in gl}
        rv = {l: cut[l].view(rl[l]) for l in members if not in_place[l]}
        # Leaves passed whole (Adam's count, per-leaf scalars) are read
        # from the old state in every slice; the carry keeps the last
        # slice's result (the same in every slice: separable checked it).
        carry = dict(
            p={l: cut[l].view(pl[l]) for l in members},
            o={j: ocut[j].view(ol[j]) for j in sliced_o},
            w={j: ol[j] for j in whole_o},
            c={l: cut[l].view(comp[l]) for l in members} if cast else {})

        def body(carry, i):
          ps = {l: f32(cut[l].take(rv[l] if l in rv else carry["p"][l], i))
                for l in members}
          gs = {l: _to_device(cut[l].take(gv[l], i)) for l in gv}
          os_ = {j: _to_device(ocut[j].take(carry["o"][j], i))
                 for j in sliced_o}
          os_.update({j: _to_device(ol[j]) for j in whole_o})
          new_p, new_o = one(gs, ps, os_)
          out = dict(
              p={l: cut[l].put(carry["p"][l], put_p(new_p[l]), i)
                 for l in members},
              o={j: ocut[j].put(carry["o"][j], put_o(new_o[j]), i)
                 for j in sliced_o},
              w={j: put_o(new_o[j]) for j in whole_o},
              c={l: cut[l].put(carry["c"][l],
                               new_p[l].astype(compute_dtype), i)
                 for l in members} if cast else {})
          return out, None

        carry, _ = jax.lax.scan(body, carry, jnp.arange(k))
        out_p = {l: carry["p"][l].reshape(self.shapes[l]) for l in members}
        out_o = {j: carry["o"][j].reshape(self.opt_shapes[j])
                 for j in sliced_o}
        out_o.update(carry["w"])
        out_c = ({l: carry["c"][l].reshape(self.shapes[l])
                  for l in members} if cast else {})
      for l in members:
        p[l] = out_p[l]
        if cast:
          comp[l] = out_c[l]
      for j in oj:
        if self.owner[j] is not None or keep_shared:
          o[j] = out_o[j]
      shared_done = True
      token = (tuple(out_p.values()), tuple(out_o.values()))
    return p, o, comp
