"""The fused host optimizer: ZeRO-Offload's update on host buffers that
zero_jax owns (``update_on="host"`` with an optimizer of
``zero_jax.offload``'s ``adamw``, ``adam``, ``lion``, ``sgd`` or
``adagrad``).

The fp32 master and the optimizer state are page-aligned numpy arrays,
neither on XLA:CPU devices nor in XLA's pinned-host allocator (whose
default 64 GB capped the model). A step:

1. the gradients come to host memory as backward left them (16-bit where
   the reduction made them so) and one kernel pass sums their squares
   (float64): the global norm and the finite check;
2. the step's scalars come from the layout's ``prepare`` (loss scale,
   skip, clipping) and from optax itself: ``tx.update`` runs on a stub of
   the state whose parameter-shaped leaves hold one element, so counts,
   injected hyperparameters and schedules advance exactly as optax
   advances them, and the kernel reads this step's learning rate, betas
   and bias corrections from the result;
3. one kernel per leaf updates master and state in place and writes the
   16-bit compute copy in the same pass (``_kernels``).

The compute copy goes to two host buffers in turn (the device copies one
while the next update writes the other). Each step returns new views of
the same buffers; ``live`` tells the last step's from older ones, which
the engine refuses as it refuses a donated state.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import SingleDeviceSharding

from zero_jax.offload import _kernels
from zero_jax.offload._buffers import aligned, owned
from zero_jax.offload._optimizers import (HostRule, Kind, decays,
                                          find_state, per_leaf_state)
from zero_jax.offload._registry import ALL, PENDING


class FusedUpdate:
  """The optimizer update by the fused kernels, on host buffers.

  The same interface as ``HostUpdate``, which ``OnHost`` drives.

  Args:
    tx: an optimizer built by ``zero_jax.offload``'s constructors.
    rule: its rule (``rule_of(tx)``).
    master: the fp32 master as ``jax.ShapeDtypeStruct`` leaves (a tree).
    cpu: the CPU device where restored state arrives and the step's
      scalar programs run.
    delayed: updates run in the background (``delay_update``).
  """

  fused = True
  resumed: Any = None  # (what a tier on disk resumed: ``NvmeUpdate``)
  in_ram = "master and state"  # (what host_bytes counts beside the copy)

  def __init__(self, tx: optax.GradientTransformation, rule: HostRule,
               master: Any, cpu: Any, delayed: bool = False):
    self.tx, self.rule, self.cpu, self.delayed = tx, rule, cpu, delayed
    self.master_shapes = master
    self.opt_shapes = jax.eval_shape(tx.init, master)
    on_cpu = SingleDeviceSharding(cpu)
    # (Where a checkpoint restores the state to, before it is adopted.)
    self.master_shardings = jax.tree.map(lambda _: on_cpu, master)
    self.opt_shardings = jax.tree.map(lambda _: on_cpu, self.opt_shapes)
    self._decay = decays(rule, master)
    # The stub: every parameter one element (of its rank, at least 1).
    self._stub_params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((1,) * max(len(x.shape), 1),
                                       jnp.float32), master)
    stub_opt = jax.tree.leaves(jax.eval_shape(tx.init, self._stub_params))
    self._big = [len(s.shape) > 0 for s in stub_opt]
    self._stub_shapes = stub_opt
    self._stub = jax.jit(self._stub_update)
    self._scalars: dict[Any, Callable] = {}
    self._copies: list[list[np.ndarray] | None] = [None, None]
    self._sent: list[Any] = [None, None]
    self._turn = 0
    self._live: dict[int, np.ndarray] = {}
    self._worker: concurrent.futures.ThreadPoolExecutor | None = None
    self._pending: concurrent.futures.Future | None = None
    self._writing: int | None = None  # (the copy buffer it writes)
    self._assembled: list[Any] = [None, None]  # (each copy as returned)
    self.compile_seconds: float | None = None
    # Seconds of the last update's phases (the update's own in the
    # background: it overlaps the next step).
    self.seconds: dict[str, float] = {}
    self.background_updates = 0  # (updates run on the updater's thread)
    ALL.add(self)

  # ------------------------------------------------------------ state

  def wait(self) -> None:
    """Waits for a background update (``update(background=True)``) to
    finish; its error, if it failed, is raised here."""
    pending, self._pending, self._writing = self._pending, None, None
    PENDING.discard(self)
    if pending is not None:
      pending.result()

  def live(self, x: Any) -> bool:
    """Whether ``x`` is a view of the state this updater returned last."""
    return self._live.get(id(x)) is x

  def owns(self, x: Any) -> bool:
    """Whether ``x`` is host state this updater writes in place."""
    return self.live(x)

  def hold(self, tree: Any, wait: Callable[[], None]) -> None:
    """A reader of ``tree`` until ``wait()``: nothing to do (``owns``)."""

  # The state as blocks: per leaf, the arrays this process updates (one
  # here: the leaf; ``MirroredFused``: its devices' shards).

  def _blocks(self, tree: Any) -> list[list[np.ndarray]]:
    """Per leaf of host state ``tree``, its writable blocks."""
    return [[x] for x in jax.tree.leaves(tree)]

  def _grad_blocks(self, grads: Any) -> Iterator[list[np.ndarray]]:
    """Per gradient leaf in turn, the contiguous blocks matching the
    master's (every leaf's copy to the host started first, so that each
    leaf's norm overlaps the copies of the next)."""
    leaves = jax.tree.leaves(grads)
    for x in leaves:
      if isinstance(x, jax.Array):
        x.copy_to_host_async()
    for x in leaves:
      yield [np.ascontiguousarray(np.asarray(x))]

  def _counted(self, j: int, b: int) -> bool:
    """Whether block ``b`` of leaf ``j`` counts in the norm (once each)."""
    del j, b
    return True

  def _total(self, sumsq: float) -> float:
    """The norm's sum of squares over every process's blocks."""
    return sumsq

  def _block_shapes(self) -> list[list[tuple]]:
    """Per master leaf, its blocks' shapes."""
    return [[tuple(x.shape)] for x in jax.tree.leaves(self.master_shapes)]

  def _leaf(self, j: int, blocks: list[np.ndarray]) -> Any:
    """Leaf ``j`` of a compute copy from its blocks, as ``to_device``
    takes it."""
    del j
    return blocks[0]

  def _assemble(self, blocks: list[list[np.ndarray]]) -> Any:
    """A compute copy's blocks as the tree ``to_device`` takes."""
    return jax.tree.unflatten(jax.tree.structure(self.master_shapes),
                              [self._leaf(j, b) for j, b in
                               enumerate(blocks)])

  @staticmethod
  def _local(tree: Any) -> Any:
    """Small arrays (replicated, any devices) as this process's copy."""
    return jax.tree.map(lambda x: x.addressable_data(0) if isinstance(
        x, jax.Array) else x, tree)

  def _publish(self, master: Any, opt_state: Any, updated: bool = False
               ) -> tuple[Any, Any]:
    # New views of the same buffers, the live ones from now on. (A tier on
    # disk shows the version an update writes: ``updated``.)
    del updated
    master, opt_state = jax.tree.map(lambda x: x.view(), (master, opt_state))
    self._live = {id(x): x for x in jax.tree.leaves((master, opt_state))}
    return master, opt_state

  def adopt(self, master: Any, opt_state: Any, commit: Any = None
            ) -> tuple[Any, Any]:
    """Master and optimizer state (arrays anywhere: a restore's, an
    init's) copied into host buffers, one leaf at a time. (``commit``: as
    ``update``'s, for a tier on disk.)"""
    del commit
    self.wait()
    master = jax.tree.map(lambda x: owned(x, np.float32), master)
    opt_state = jax.tree.map(owned, opt_state)
    return self._publish(master, opt_state)

  def init(self, master: Any, commit: Any = None) -> tuple[Any, Any]:
    """The host master (from ``master``, any arrays) and ``tx.init`` of it,
    both in host buffers."""
    del commit
    master = jax.tree.map(lambda x: owned(x, np.float32), master)
    with jax.default_device(self.cpu):
      opt_state = jax.jit(self.tx.init)(master)
    return self.adopt(master, opt_state)

  def fits(self, tree: Any, dtype: Any) -> bool:
    """Never: the compute copy's buffers are this updater's own."""
    del tree, dtype
    return False

  def to_device(self, tree: Any, shardings: Any) -> Any:
    """``tree`` (host arrays) copied to ``shardings``; a compute copy's
    buffer is not written again until this copy is done. (Waits for a
    background update unless ``tree`` is a compute copy it is not
    writing.)"""
    copy = [i for i, t in enumerate(self._assembled) if t is tree]
    if not copy or copy[0] == self._writing:
      self.wait()
    out = self._send(tree, shardings)
    for i in copy:
      self._sent[i] = out
    if not copy:
      jax.block_until_ready(out)  # (the master: the next update writes it)
    return out

  def _send(self, tree: Any, shardings: Any) -> Any:
    """``tree`` (host buffers) copied to ``shardings`` (started: JAX's
    copies run asynchronously)."""
    # (The tree's shardings are on one mesh: its first device tells.)
    devices = jax.tree.leaves(shardings)[0].device_set
    if next(iter(devices)).platform == "cpu" and (len(devices) > 1 or
                                                   self.delayed):
      # JAX's CPU devices take an aligned numpy array as their buffer
      # (may_alias=False or not): give them one that nothing writes. (One
      # CPU device takes the buffer itself as the compute copy: without
      # delay_update the next update writes it once the step that read it
      # is done, and RAM holds one copy, not two.)
      tree = jax.tree.map(self._detached, tree)
    return self._put(tree, shardings)

  _detached = staticmethod(np.array)  # (a copy that shares no buffer)

  def _put(self, tree: Any, shardings: Any) -> Any:
    """``tree`` (host state) moved to ``shardings`` on the mesh."""
    return jax.device_put(tree, shardings, may_alias=False)

  def host_bytes(self, copy_dtype: Any, grad_dtype: Any,
                 background: bool = False) -> int:
    """Host RAM the update holds: master and optimizer state, the compute
    copy (two in the background: one being sent while the next is
    written), and the gradients as they arrive."""
    n = sum(x.size for x in jax.tree.leaves(self.master_shapes))
    copies = 2 if background else int(np.dtype(copy_dtype) != np.float32)
    return (self.state_bytes() + copies * n * np.dtype(copy_dtype).itemsize
            + n * np.dtype(grad_dtype).itemsize)

  def state_bytes(self) -> int:
    """Bytes of the fp32 master and the optimizer state."""
    return sum(x.size * np.dtype(x.dtype).itemsize for x in
               jax.tree.leaves((self.master_shapes, self.opt_shapes)))

  def describe(self) -> str:
    """One line for ``Engine.describe()``."""
    k = _kernels.kernels()
    compiled = ("" if self.compile_seconds is None else
                f"; kernels compiled or loaded in {self.compile_seconds:.1f} "
                "s")
    what = self.rule.kind.value + (
        ", DeepSpeed's" if self.rule.deepspeed is not None else "")
    last = ", ".join(f"{phase} {t * 1e3:,.1f} ms"
                     for phase, t in self.seconds.items())
    return (f"fused host optimizer ({what}, numba) on "
            f"{k.max_threads} thread(s), master and state in host buffers; "
            "one pass a step, the compute copy written in it" + compiled +
            (f"; the last update: {last}" if last else ""))

  # ----------------------------------------------------------- update

  def _stub_update(self, small: list):
    """optax's update of the stub state (zero gradients: only its scalars
    are kept): the scalar leaves after this step, and the kernel's
    coefficients read from them."""
    it = iter(small)
    leaves = [jnp.zeros(s.shape, s.dtype) if big else next(it)
              for s, big in zip(self._stub_shapes, self._big)]
    state = jax.tree.unflatten(jax.tree.structure(self.opt_shapes), leaves)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         self._stub_params)
    _, new = self.tx.update(zeros, state, zeros)
    form = self.rule.deepspeed
    if form is not None:
      # zj.initialize's chain: (DeepSpeed's direction, the injected rate).
      coef = {**form.coefficients(state[0].count),
              "learning_rate": new[1].hyperparams["learning_rate"],
              "weight_decay" if form.decoupled else "l2": form.weight_decay}
    else:
      coef = dict(new.hyperparams)
      if self.rule.kind is Kind.ADAM:
        count = find_state(new, optax.ScaleByAdamState).count
        # optax.tree.bias_correction's 1 - decay**count, as optax does it.
        coef["bc1"] = 1 - coef["b1"] ** count
        coef["bc2"] = 1 - coef["b2"] ** count
    coef = {k: jnp.asarray(v, jnp.float32) for k, v in coef.items()}
    return [x for x, big in zip(jax.tree.leaves(new), self._big)
            if not big], coef

  def _copy_buffer(self, dtype: Any, separate: bool = False
                   ) -> tuple[int, list[np.ndarray] | None]:
    """The compute copy's buffer this update writes (None: the copy is the
    fp32 master itself, unless ``separate``), once the copy out of it is
    done."""
    for sent in self._sent:  # (the master may have been sent too)
      if sent is not None:
        jax.block_until_ready(sent)
    self._sent = [None, None]
    if jnp.dtype(dtype) == jnp.float32 and not separate:
      return -1, None
    # (Two in turn in the background, where the next step reads one while
    # the next update writes the other; else one.)
    i = self._turn
    if separate:
      self._turn = 1 - self._turn
    bufs = self._copies[i]
    if bufs is None or bufs[0][0].dtype != jnp.dtype(dtype):
      bufs = [[aligned(shape, dtype) for shape in shapes]
              for shapes in self._block_shapes()]
      self._copies[i] = bufs
    return i, bufs

  def _copy_tree(self, i: int, bufs: list[list[np.ndarray]]) -> Any:
    """Copy buffer ``i`` as the tree ``to_device`` is given."""
    self._assembled[i] = self._assemble(bufs)
    return self._assembled[i]

  def cast(self, master: Any, compute_dtype: Any) -> Any:
    """The compute copy of ``master`` in host memory."""
    self.wait()
    i, bufs = self._copy_buffer(compute_dtype)
    if bufs is None:
      return master
    self._cast_into(_kernels.kernels(), master, bufs)
    return self._copy_tree(i, bufs)

  def _cast_into(self, k, master: Any, bufs: list) -> None:
    """``master`` cast into the copy buffers ``bufs`` by kernels ``k``."""
    for ps, outs in zip(self._blocks(master), bufs):
      for p, out in zip(ps, outs):
        k.cast(p.reshape(-1), _kernels.as_kernel_array(out))

  def update(self, grads: Any, master: Any, opt_state: Any, extra: Any, *,
             prepare: Callable[..., tuple[Any, Any, Any]],
             compute_dtype: Any, into: Any = None, background: bool = False,
             send: Any = None, commit: Callable | None = None
             ) -> tuple[Any, Any, Any, Any]:
    """One update, in place.

    Args:
      grads: the gradients as backward left them (any devices or memory).
      master, opt_state: the live host state.
      extra: small arrays ``prepare`` reads.
      prepare: ``prepare(sumsq, extra) -> ((divisor, clip, norm, c),
        finite, out)``: the gradients' scaling from the sum of their
        squares, whether to apply them (None: always) and what else to
        return.
      compute_dtype: the compute copy's dtype.
      into: unused (``HostUpdate``'s buffer reuse; these buffers are
        reused always).
      background: run the kernels on this updater's thread and return
        once the gradients are read and the step's scalars known
        (``delay_update``: the host's update overlaps the device's next
        step). Whatever reads the state waits for them first (``wait``,
        ``settle``).
      send: the compute copy's shardings (not with ``background``): each
        leaf's copy starts for the device as soon as its kernel has
        written it, so that the upload of one leaf overlaps the update of
        the next; the compute copy returned is then the device's.
      commit: ``commit(out)`` is the small tree (the train state's step
        and loss scale) that a tier outliving the process commits with the
        state (``NvmeUpdate``); None here.

    Returns:
      ``(master, opt_state, compute, out)``: new views of the host state,
      the compute copy (host arrays, or the device's with ``send``), and
      ``prepare``'s ``out``.
    """
    del into
    assert send is None or not background, "send or background, not both"
    self.wait()
    k = _kernels.kernels()
    start = clock = time.perf_counter()

    def lap(phase: str) -> None:
      nonlocal clock
      now = time.perf_counter()
      self.seconds[phase] = now - clock
      clock = now

    g, total = [], 0.0
    for j, blocks in enumerate(self._grad_blocks(grads)):
      g.append([_kernels.as_kernel_array(x) for x in blocks])
      total += sum(k.sumsq(x) for b, x in enumerate(g[-1])
                   if self._counted(j, b))
    sumsq = np.float32(self._total(total))
    lap("gradients to the host and their norm")
    with jax.default_device(self.cpu):
      (divisor, clip, norm, c), finite, out = self._scalars_of(prepare)(
          sumsq, jax.device_put(self._local(extra), self.cpu))
    kept = None if commit is None else commit(out)
    if finite is not None and not bool(finite):
      # Skipped: master and state stay, the copy is cast afresh.
      self._skipped(kept)
      master, opt_state = self._publish(master, opt_state)
      compute = self.cast(master, compute_dtype)
      if send is not None:
        compute = self.to_device(compute, send)
      return master, opt_state, compute, out
    opt_blocks = self._blocks(opt_state)
    small = [b for b, big in zip(opt_blocks, self._big) if not big]
    with jax.default_device(self.cpu):
      new_small, coef = self._stub([b[0] for b in small])
    coef = {name: np.float32(v) for name, v in coef.items()}
    scaling = ((np.float32(divisor), np.float32(norm), np.float32(c))
               if bool(clip) else (np.float32(divisor), np.float32(1),
                                   np.float32(1)))
    # (In the background the next step may read the last copy while this
    # one is written: a buffer of its own even in float32.)
    writing, bufs = self._copy_buffer(compute_dtype, separate=background)
    master_blocks = self._blocks(master)
    per_leaf = per_leaf_state(
        [b for b, big in zip(opt_blocks, self._big) if big],
        len(master_blocks))
    for blocks, v in zip(small, new_small):
      for x in blocks:
        x[...] = np.asarray(v)
    lap("scalars")

    # (Each leaf's copy sent as soon as it is written: ``send``.)
    targets = (None if send is None or bufs is None else
               jax.tree.leaves(send))
    sent, sending = {}, [0.0]

    def leaf_done(j: int) -> None:
      if targets is not None:
        begun = time.perf_counter()
        sent[j] = self._send(self._leaf(j, bufs[j]), targets[j])
        sending[0] += time.perf_counter() - begun

    def kernels():
      self._update_leaves(k, g, master_blocks, per_leaf, bufs,
                          (scaling, coef), leaf_done)
      self._commit(kept)
      self.seconds["update"] = time.perf_counter() - clock - sending[0]
      if targets is not None:
        self.seconds["starting the copies to the device"] = sending[0]
      if self.compile_seconds is None:
        self.compile_seconds = time.perf_counter() - start

    if background:
      if self._worker is None:
        self._worker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="zero_jax-host-update")
      self._pending = self._worker.submit(kernels)
      self._writing = writing
      self.background_updates += 1
      PENDING.add(self)
    else:
      kernels()
    master, opt_state = self._publish(master, opt_state, updated=True)
    if targets is not None:
      # (The next update writes this buffer once these copies are done.)
      compute = self._sent[writing] = jax.tree.unflatten(
          jax.tree.structure(send), [sent[j] for j in range(len(sent))])
    elif bufs is not None:
      compute = self._copy_tree(writing, bufs)
    else:
      compute = master  # (the copy is the fp32 master itself)
      if send is not None:
        compute = self.to_device(compute, send)
    return master, opt_state, compute, out

  def _scalars_of(self, prepare: Callable) -> Callable:
    if prepare not in self._scalars:
      self._scalars[prepare] = jax.jit(prepare)
    return self._scalars[prepare]

  def _update_leaves(self, k, g: list, master_blocks: list, per_leaf: list,
                     bufs: list | None, step: tuple,
                     leaf_done: Callable[[int], None]) -> None:
    """Every leaf's kernel, ``leaf_done(j)`` once leaf ``j``'s copy is
    written. (``step``: the gradients' scaling and the coefficients.)"""
    for j, ps in enumerate(master_blocks):
      for b, p in enumerate(ps):
        out = (_kernels.NOTHING if bufs is None else
               _kernels.as_kernel_array(bufs[j][b]))
        self._run(k, p.reshape(-1), g[j][b],
                  [s[b].reshape(-1) for s in per_leaf[j]], out, *step,
                  self._decay[j])
      leaf_done(j)

  def _skipped(self, kept: Any) -> None:
    """A skipped step's hook (a tier on disk commits ``kept``)."""

  def _commit(self, kept: Any) -> None:
    """An update's last hook (a tier on disk commits ``kept``)."""

  def _run(self, k, p, g, state, out, scaling, coef, decays) -> None:
    """One leaf's kernel."""
    _kernels.apply(k, self.rule, p, g, state, out, scaling, coef, decays)
