"""Bytes a compiled step moves between host and device memory (PCIe).

Offloaded state lives in host memory (memory space 5, ``S(5)`` in the
compiled HLO's layouts). XLA moves it with copies (``copy-start``) and with
asynchronous dynamic slices and updates (``fusion-start`` of a wrapped
``dynamic-slice`` / ``dynamic-update-slice``), or with synchronous fusions
that read or write host memory. Each such instruction is counted once per
execution, loops weighted by their trip counts (``_hlo.executions``):

- an instruction whose result is in device memory and that reads a host
  array moves ``min(result bytes, host operand bytes)`` to the device (a
  dynamic slice moves its slice, a copy its array);
- one whose result is in host memory and that reads device arrays moves
  ``min(result bytes, device operand bytes)`` to the host (a dynamic update
  moves its update).

Only instructions of the entry computation, of while bodies and conditions
and of called computations are read; a fusion's own computation is not (the
fusion is counted where it is called). What the program's caller moves
(``jax.device_put`` of its arguments, reads of its outputs) is not in the
program: ``update_on="host"`` adds the gradients it returns in device memory
and the compute copy it is given (``CompiledStep.transfers``).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from zero_jax.analysis import _hlo

# "%name = f32[2,256]{1,0:S(5)} op(" and tuple results "(f32[..]{..}, ..)".
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*"
                    r"(?P<result>\(.*?\)|\S+)\s+(?P<op>[a-z][a-z0-9_-]*)\(")
_OPERANDS = re.compile(r"%(?P<name>[^\s,)]+)")
# Instructions that only rename, wait or hold: never a transfer of their own.
_NO_TRANSFER = frozenset((
    "parameter", "get-tuple-element", "tuple", "bitcast", "while",
    "call", "conditional", "copy-done", "fusion-done", "constant",
    "opt-barrier", "after-all", "custom-call", "send", "recv", "send-done",
    "recv-done"))


@dataclasses.dataclass(frozen=True)
class Array:
  """One array of an instruction's result."""

  nbytes: int
  on_host: bool


@dataclasses.dataclass(frozen=True)
class Transfers:
  """Host <-> device bytes of one step.

  Attributes:
    to_device: bytes read from host memory into device memory.
    to_host: bytes written from device memory into host memory.
    instructions: ``(name, op, direction, bytes per execution,
      executions)`` of every transfer counted, for inspection.
  """

  to_device: int
  to_host: int
  instructions: tuple[tuple[str, str, str, int, int], ...] = ()

  @property
  def total(self) -> int:
    """Both directions."""
    return self.to_device + self.to_host

  def __add__(self, other: "Transfers") -> "Transfers":
    return Transfers(self.to_device + other.to_device,
                     self.to_host + other.to_host,
                     self.instructions + other.instructions)


def _arrays(text: str) -> list[Array]:
  return [Array(int(np.prod(dims, dtype=np.int64)) * _hlo.dtype_bytes(dtype),
                "S(5)" in layout) for dtype, dims, layout in _hlo.arrays(text)]


def _direction(result: list[Array], operands: list[list[Array]]
               ) -> tuple[str, int] | None:
  """("to_device" | "to_host", bytes) of one instruction, or None."""
  flat = [a for arrays in operands for a in arrays]
  host_in = sum(a.nbytes for a in flat if a.on_host)
  device_in = sum(a.nbytes for a in flat if not a.on_host)
  host_out = sum(a.nbytes for a in result if a.on_host)
  device_out = sum(a.nbytes for a in result if not a.on_host)
  if host_out and device_in:
    return "to_host", min(host_out, device_in)
  if device_out and host_in:
    return "to_device", min(device_out, host_in)
  return None


def host_transfers(hlo_text: str) -> Transfers:
  """Host <-> device bytes per step of ``compiled.as_text()``.

  Args:
    hlo_text: the compiled program's HLO (compiled for a GPU: programs
      compiled for CPU devices keep host memory in place and move nothing).

  Returns:
    The ``Transfers``.
  """
  executions = _hlo.executions(hlo_text, follow_fusions=False)
  to_device = to_host = 0
  found = []
  current, shapes = None, {}
  for line in hlo_text.splitlines():
    header = _hlo.computation_name(line)
    if header is not None:
      current, shapes = header, {}
      continue
    m = _INSTR.match(line)
    if current is None or m is None:
      continue
    name, op, result = m.group("name"), m.group("op"), m.group("result")
    arrays = _arrays(result)
    shapes[name] = arrays
    times = executions.get(current, 0)
    if not times or op in _NO_TRANSFER:
      continue
    if op.endswith("-start") and result.startswith("(("):
      # An async start's result is (operands, result, context): the
      # operands' arrays come first and are read from the line's operands.
      n_operands = len(_arrays(result[1:_hlo.closing_paren(result, 1) + 1]))
      arrays = arrays[n_operands:n_operands + 1]
    elif op == "copy-start":
      # (destination, source, context)
      arrays = arrays[:1]
    args = line[m.end():]
    operands = [shapes.get(o.group("name"), []) for o in
                _OPERANDS.finditer(args.split("), ")[0] + ")")]
    d = _direction(arrays, operands)
    if d is None:
      continue
    kind, nbytes = d
    found.append((name, op, kind, nbytes, times))
    if kind == "to_device":
      to_device += nbytes * times
    else:
      to_host += nbytes * times
  return Transfers(to_device, to_host, tuple(found))


def device_outputs_bytes(hlo_text: str) -> int:
  """Bytes of the entry computation's outputs that stay in device memory
  (its layout's results without ``S(5)``)."""
  first = hlo_text.split("\n", 1)[0]
  key = "entry_computation_layout={("
  start = first.find(key)
  if start < 0:
    return 0
  args_end = _hlo.closing_paren(first, start + len(key) - 1)
  out = first[args_end + 1:]
  if not out.startswith("->"):
    return 0
  out = out[2:]
  if out.startswith("("):
    out = out[:_hlo.closing_paren(out, 0) + 1]
  else:
    out = out.split("}", 1)[0] + "}"
  return sum(a.nbytes for a in _arrays(out) if not a.on_host)


