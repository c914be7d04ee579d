"""Which collectives of a compiled GPU program overlap a gemm.

XLA's GPU backend runs collectives asynchronously: a ``-start`` launches
one on its own stream and a ``-done`` waits for it, and its scheduler
places independent work between the two. That work hides the collective's
time only if it is long enough, and in a transformer step the long kernels
are the matrix multiplications. ``overlap`` reads a compiled, scheduled
program (``compiled.as_text()``, ``is_scheduled=true``: each computation's
instructions are printed in the order they run) and, for every
asynchronous collective, names the gemms scheduled between its start and
its done. The collectives XLA leaves synchronous (a plain ``all-gather``)
are listed too, overlapping nothing, so that counts cover every collective
the step runs.

The async forms read: ``all-gather-start``/``-done``,
``all-reduce-start``/``-done``, ``reduce-scatter-start``/``-done``,
``all-to-all-start``/``-done`` and ``collective-permute-start``/``-done``
(what jax 0.10's XLA emits), and ``async-start`` (``async-update``)
``async-done`` wrapping a computation whose instruction is one of those
collectives (the generic form other XLA versions use for reduce-scatter
and all-to-all).

The rule for a gemm (an instruction that does a matrix product):
- a ``custom-call`` to cuBLAS (``__cublas$gemm``, ``__cublas$lt$matmul``,
  any ``__cublas$`` target) or to cuDNN's attention (``__cudnn$fmha...``,
  forward and backward: two batched matmuls each);
- a ``fusion`` of kind ``kCustom`` whose fused computation, nested fusions
  included, holds a ``dot`` or such a custom call: Triton gemm fusions
  (``__triton_gemm``, ``__triton_nested_gemm_fusion``), cuDNN fusions
  (``__cudnn$fusion``), a cuBLAS call in a dynamic-slice fusion. Other
  ``kCustom`` fusions (elementwise Triton fusions, slices) are not gemms;
- a ``dot`` itself (a scheduled GPU program has none outside fusions);
- a ``while``, ``call``, ``conditional`` or non-collective ``async-start``
  whose computations run a gemm: a collective in flight across a loop
  overlaps that loop's matmuls.
Convolutions are not counted (the programs measured have none).

The window of a collective is the instructions strictly between its start
and its done in their computation. Where XLA's collective pipeliner or the
scheduler carries a collective across a loop iteration (the start late in
a while body, its done in the next iteration: the done reads the start
through the loop's tuple), the window is the rest of the body after the
start plus the body before the done. A start before a loop whose done is
in the loop's first iteration has the caller's instructions up to the loop
plus the body before the done; a body's start whose done follows the loop
(the last iteration's, when no in-body done waits for it) has the rest of
the body plus the caller's instructions after the loop.

Each collective is weighted by how often one step runs its computation (a
scanned layer's body: once per layer; ``zero_jax.analysis.collectives``'
trip counts), so counts are per step.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable

import numpy as np

from zero_jax.analysis import _hlo as hlo

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
         "collective-permute")
_STARTS = {f"{k}-start": k for k in KINDS}
_DONES = {f"{k}-done" for k in KINDS} | {"async-done"}
# Ops that run other computations as part of the schedule (a gemm in them
# runs while a collective started before them is in flight).
_CONTROL = ("while", "call", "conditional", "async-start")

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*")
_OPCODE = re.compile(r"\s*(?P<op>[a-z][\w\-.]*)\(")
_TARGET = re.compile(r'custom_call_target="(?P<t>[^"]*)"')
_GEMM_TARGET = re.compile(r"^__cublas\$|^__cudnn\$fmha")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|"
                     r"false_computation)=%(?P<one>[^\s,}]+)|"
                     r"\b(?:calls|branch_computations)=\{(?P<many>[^}]*)\}")
_INDEX = re.compile(r"\bindex=(?P<k>\d+)")


@dataclasses.dataclass(frozen=True)
class _Op:
  """One HLO instruction: its name, result shape text, opcode, operands
  (names), what it calls and its line."""

  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  callees: tuple[str, ...]
  line: str

  @property
  def is_root(self) -> bool:
    return self.line.lstrip().startswith("ROOT ")


@dataclasses.dataclass(frozen=True)
class AsyncCollective:
  """One collective of a compiled program, asynchronous or not.

  Attributes:
    kind: ``"all-gather"``, ``"reduce-scatter"``, ``"all-reduce"``,
      ``"all-to-all"`` or ``"collective-permute"``.
    start: the name of its start instruction (``all-gather-start.3``; a
      synchronous one's own name).
    done: the name of the done that waits for it (None where none was
      found, the window then running to the end of the computation; and
      for a synchronous one).
    computation: the computation the start is in (a while body for a
      scanned layer's collectives).
    shapes: result shapes (a combined collective has several).
    dtypes: result element types, HLO spelling (``bf16``, ``f32``).
    bytes: result bytes per execution.
    executions: how often one step runs it (enclosing loops' trip counts).
    gemms: the gemms scheduled in its window (see the module docstring),
      by instruction name, in schedule order.
    across_iterations: its done is in a later loop iteration than its
      start, or outside the loop the start is in.
    asynchronous: False for a collective XLA left synchronous (no start
      and done: nothing overlaps it).
  """

  kind: str
  start: str
  done: str | None
  computation: str
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  bytes: int
  executions: int = 1
  gemms: tuple[str, ...] = ()
  across_iterations: bool = False
  asynchronous: bool = True

  @property
  def overlapped(self) -> bool:
    """Whether at least one gemm runs while it is in flight."""
    return bool(self.gemms)

  @property
  def dtype(self) -> str:
    """Its element type (``"mixed"`` for a combined one of several)."""
    return self.dtypes[0] if len(set(self.dtypes)) == 1 else "mixed"


@dataclasses.dataclass(frozen=True)
class OverlapCount:
  """Executions per step of one kind of collective.

  Attributes:
    total: all of them.
    overlapped: those with at least one gemm in their window.
    bytes: result bytes of all of them.
    overlapped_bytes: result bytes of the overlapped ones (a few small
      collectives overlapping while the large ones do not shows here).
  """

  total: int = 0
  overlapped: int = 0
  bytes: int = 0
  overlapped_bytes: int = 0

  def __str__(self) -> str:
    return f"{self.overlapped}/{self.total}"


def _parse_op(line: str) -> _Op | None:
  m = _INSTRUCTION.match(line)
  if not m:
    return None
  pos = m.end()
  if line.startswith("(", pos):
    end = hlo.closing_paren(line, pos) + 1
  else:
    end = pos + len(line[pos:].split(None, 1)[0])
  shape = line[pos:end]
  op = _OPCODE.match(line, end)
  if not op:
    return None
  close = hlo.closing_paren(line, op.end() - 1) + 1
  operands = tuple(re.findall(r"%([^\s,)]+)", line[op.end():close - 1]))
  rest = line[close:]
  callees = []
  for c in _CALLEE.finditer(rest):
    callees += ([c.group("one")] if c.group("one") else
                [x.strip().lstrip("%") for x in c.group("many").split(",")
                 if x.strip()])
  return _Op(m.group("name"), shape, op.group("op"), operands,
             tuple(callees), line)


def _program(hlo_text: str) -> dict[str, list[_Op]]:
  """``{computation: its instructions in schedule order}``."""
  out: dict[str, list[_Op]] = {}
  current = None
  for line in hlo_text.splitlines():
    name = hlo.computation_name(line)
    if name is not None:
      current = out.setdefault(name, [])
      continue
    if current is not None and (op := _parse_op(line)) is not None:
      current.append(op)
  return out


class _Gemms:
  """The gemm rule of the module docstring, memoized per computation."""

  def __init__(self, program: dict[str, list[_Op]]):
    self._program = program
    self._has: dict[str, bool] = {}

  def has_gemm(self, computation: str) -> bool:
    """Whether ``computation`` (with what it calls) runs a gemm."""
    if computation not in self._has:
      self._has[computation] = False  # (guards against cycles)
      self._has[computation] = any(
          op.opcode == "dot" or self._gemm_call(op) or
          any(self.has_gemm(c) for c in op.callees)
          for op in self._program.get(computation, ()))
    return self._has[computation]

  @staticmethod
  def _gemm_call(op: _Op) -> bool:
    t = _TARGET.search(op.line) if op.opcode == "custom-call" else None
    return bool(t and _GEMM_TARGET.search(t.group("t")))

  def is_gemm(self, op: _Op) -> bool:
    """Whether one scheduled instruction is (or runs) a gemm."""
    if op.opcode == "dot" or self._gemm_call(op):
      return True
    if op.opcode == "fusion":
      return ("kind=kCustom" in op.line and
              any(self.has_gemm(c) for c in op.callees))
    if op.opcode in _CONTROL:
      return any(self.has_gemm(c) for c in op.callees)
    return False


def _kind(op: _Op, program: dict[str, list[_Op]]) -> str | None:
  """The collective a start instruction launches, or None."""
  if op.opcode in _STARTS:
    return _STARTS[op.opcode]
  if op.opcode == "async-start":
    for c in op.callees:
      for inner in program.get(c, ()):
        if inner.opcode in KINDS:
          return inner.opcode
  return None


def _result_arrays(start: _Op, done: _Op | None
                   ) -> list[tuple[str, tuple[int, ...], str]]:
  if done is not None:
    return hlo.arrays(done.shape)
  if start.opcode in ("all-reduce-start", *KINDS):
    return hlo.arrays(start.shape)
  # (operands, results, contexts...): the second top-level element.
  inner, depth, parts, begin = start.shape[1:-1], 0, [], 0
  for i, ch in enumerate(inner):
    depth += ch == "("
    depth -= ch == ")"
    if ch == "," and depth == 0:
      parts.append(inner[begin:i])
      begin = i + 1
  parts.append(inner[begin:])
  return hlo.arrays(parts[1] if len(parts) > 1 else start.shape)


def _pairs(program: dict[str, list[_Op]]
           ) -> dict[tuple[str, str], tuple[_Op | None, list[_Op], bool]]:
  """``{(computation, start name): (done, window, across iterations)}``
  for every start a done waits for (direct pairs first)."""
  index = {c: {op.name: i for i, op in enumerate(ops)}
           for c, ops in program.items()}
  # body -> [(the computation calling it, the position of its while)].
  loops: dict[str, list[tuple[str, int]]] = {}
  for c, ops in program.items():
    for i, op in enumerate(ops):
      if op.opcode == "while":
        body = re.search(r"\bbody=%([^\s,}]+)", op.line)
        if body:
          loops.setdefault(body.group(1), []).append((c, i))
  found: dict[tuple[str, str], tuple[_Op | None, list[_Op], bool]] = {}

  def source(c: str, name: str) -> _Op | None:
    """The instruction that made value ``name`` of ``c``, past any
    async-update."""
    op = program[c][index[c][name]] if name in index[c] else None
    while op is not None and op.opcode == "async-update" and op.operands:
      up = op.operands[0]
      op = program[c][index[c][up]] if up in index[c] else None
    return op

  def tuple_element(c: str, tup: _Op | None, k: int) -> _Op | None:
    if tup is None or tup.opcode != "tuple" or k >= len(tup.operands):
      return None
    return source(c, tup.operands[k])

  def claim(c: str, start: _Op | None, done: _Op, window: list[_Op],
            across: bool) -> None:
    if (start is not None and _kind(start, program) and
        (c, start.name) not in found):
      found[(c, start.name)] = (done, window, across)

  dones = [(c, i, op) for c, ops in program.items()
           for i, op in enumerate(ops) if op.opcode in _DONES]
  # 1. In the same computation, the start before the done.
  for c, i, done in dones:
    s = source(c, done.operands[0]) if done.operands else None
    if s is not None and _kind(s, program):
      claim(c, s, done, program[c][index[c][s.name] + 1:i], False)
  for c, i, done in dones:
    s = source(c, done.operands[0]) if done.operands else None
    at = _INDEX.search(s.line) if s is not None else None
    if at is None or s.opcode != "get-tuple-element":
      continue
    k = int(at.group("k"))
    base = source(c, s.operands[0]) if s.operands else None
    ops = program[c]
    if base is not None and base.opcode == "parameter":
      # 2. Carried by the loop: the body's own start (previous iteration),
      # and the caller's start before the loop (first iteration).
      root = next((op for op in ops if op.is_root), None)
      start = tuple_element(c, root, k)
      if start is not None and start.name in index[c]:
        claim(c, start, done, ops[index[c][start.name] + 1:] + ops[:i], True)
      for caller, w in loops.get(c, ()):
        loop = program[caller][w]
        init = source(caller, loop.operands[0]) if loop.operands else None
        start = tuple_element(caller, init, k)
        if start is not None:
          claim(caller, start, done,
                program[caller][index[caller][start.name] + 1:w] + ops[:i],
                True)
    elif base is not None and base.opcode == "while":
      # 3. After the loop: the body's start of the last iteration.
      body = re.search(r"\bbody=%([^\s,}]+)", base.line).group(1)
      bops = program.get(body, [])
      root = next((op for op in bops if op.is_root), None)
      start = tuple_element(body, root, k)
      if start is not None:
        claim(body, start, done, bops[index[body][start.name] + 1:] +
              ops[index[c][base.name] + 1:i], True)
  return found


def overlap(hlo_text: str) -> list[AsyncCollective]:
  """Every collective of a compiled, scheduled program, with the gemms
  that run while it is in flight.

  Args:
    hlo_text: ``compiled.as_text()`` of a program compiled for a GPU
      (``zero_jax.analysis.compile_step``'s ``hlo``). A snippet without an
      entry computation counts every collective once.

  Returns:
    One ``AsyncCollective`` per start instruction (or synchronous
    collective), in the order of the text.
  """
  program = _program(hlo_text)
  # (Not through ``calls=``: an async wrapper's collective is counted at
  # its start.)
  times = hlo.executions(hlo_text, follow_fusions=False)
  rule = _Gemms(program)
  pairs = _pairs(program)
  out = []
  for c, ops in program.items():
    for i, op in enumerate(ops):
      kind = _kind(op, program)
      if kind is None and op.opcode not in KINDS:
        continue
      done, window, across = pairs.get((c, op.name), (None, ops[i + 1:],
                                                      False))
      if kind is None:  # synchronous
        kind, window = op.opcode, []
      found = _result_arrays(op, done)
      sizes = [int(np.prod(dims, dtype=np.int64)) for _, dims, _ in found]
      out.append(AsyncCollective(
          kind=kind, start=op.name, done=done.name if done else None,
          computation=c, shapes=tuple(dims for _, dims, _ in found),
          dtypes=tuple(dt for dt, _, _ in found),
          bytes=sum(n * hlo.dtype_bytes(dt)
                    for n, (dt, _, _) in zip(sizes, found)),
          executions=times.get(c, 0 if times else 1),
          gemms=tuple(x.name for x in window if rule.is_gemm(x)),
          across_iterations=across, asynchronous=op.opcode != kind))
  # (Computations no step reaches, e.g. an async wrapper's, run 0 times.)
  return [a for a in out if a.executions]


def overlap_summary(collectives: Iterable[AsyncCollective] | str,
                    by_dtype: bool = False) -> dict:
  """Per step, how many collectives of each kind overlap a gemm.

  Args:
    collectives: ``overlap``'s list, or the HLO text to read it from.
    by_dtype: key by ``(kind, dtype)`` instead of by kind.

  Returns:
    ``{kind: OverlapCount}`` (or ``{(kind, dtype): OverlapCount}``), each
    execution counted.
  """
  if isinstance(collectives, str):
    collectives = overlap(collectives)
  out: dict = {}
  for a in collectives:
    key = (a.kind, a.dtype) if by_dtype else a.kind
    c = out.get(key, OverlapCount())
    hidden = a.executions if a.overlapped else 0
    out[key] = OverlapCount(c.total + a.executions, c.overlapped + hidden,
                            c.bytes + a.bytes * a.executions,
                            c.overlapped_bytes + a.bytes * hidden)
  return out
