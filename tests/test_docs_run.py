"""Every fenced python and shell block of README.md and docs/*.md runs, on
CPU, as written.

One test per block (ids like ``docs/usage.md:42``). Each block runs in a
fresh process, in a fresh directory that links the repository's top-level
entries (so ``experiments/ds_config.json`` resolves as from the repository
root, and what a block writes stays out of it), with the repository on
``PYTHONPATH``, ``python`` on ``PATH`` meaning the interpreter running the
tests, JAX on CPU and no device count forced: a block that wants 8 devices
says so (``zj.simulate_cpu_devices(8)``). Shell blocks run line by line
(continuation lines joined) through bash.

A block's first line may say how it runs, visibly to the reader too:

- ``# not run by the docs test: <why>``: not run (a GPU, SLURM, several
  hosts, installing packages, the whole suite); the reason is required.
- ``# after the block above``: runs where the previous runnable block of
  the same page ran, in a new process (it uses the files that one wrote).
- ``# continues the block above``: a python block that goes on with the
  previous one's variables: both run as one script, in one process.
- ``# train.py`` (a file name): the block is that file, written there and
  run as ``python train.py``; a later shell block may start it again.
- ``# compiles for GPUs ...``: runs only where JAX's CUDA plugin is
  installed (a missing backend: skipped otherwise).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests import _gpu
from tests.test_docs import _blocks, _docs

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_RUNNABLE = {"python": "python", "bash": "shell", "sh": "shell",
             "shell": "shell"}
_NOT_RUN = re.compile(r"#\s*not run by the docs test\b:?\s*(.*)")
_AFTER = re.compile(r"#\s*after the block above\b")
_CONTINUES = re.compile(r"#\s*continues the block above\b")
_FILE = re.compile(r"#\s*([\w-]+\.py)\s*$")
_GPU_COMPILE = re.compile(r"#\s*compiles for GPUs\b")
# A block that runs longer than this is a documented command to make
# cheaper (small model flags), not a reason to wait.
_TIMEOUT_S = 120
# XLA's slow LLVM passes and GPU autotuning off, as tests/conftest.py
# does: they change no result, only compile time; and no device count,
# which each block sets.
_XLA_FLAGS = ("--xla_backend_optimization_level=0 "
              "--xla_llvm_disable_expensive_passes=true "
              "--xla_gpu_autotune_level=0")


@dataclasses.dataclass(frozen=True)
class DocBlock:
  """A runnable-language block of a page, where it is, and how it runs."""

  doc: pathlib.Path
  line: int
  kind: str  # "python" or "shell"
  text: str

  @property
  def id(self) -> str:
    return f"{self.doc.relative_to(_ROOT).as_posix()}:{self.line}"

  @property
  def first(self) -> str:
    lines = self.text.splitlines()
    return lines[0].strip() if lines else ""

  @property
  def not_run(self) -> str | None:
    """The reason given for not running it, or None if it runs."""
    m = _NOT_RUN.match(self.first)
    return m.group(1).strip() if m else None

  @property
  def file_name(self) -> str | None:
    m = _FILE.match(self.first)
    return m.group(1) if m and self.kind == "python" else None


def doc_blocks(doc: pathlib.Path) -> list[DocBlock]:
  return [DocBlock(doc, b.line, _RUNNABLE[b.lang], b.text)
          for b in _blocks(doc.read_text(encoding="utf-8"))
          if b.lang in _RUNNABLE]


def _all_blocks() -> list[DocBlock]:
  return [b for doc in _docs() for b in doc_blocks(doc)]


def _previous(block: DocBlock) -> DocBlock:
  runs = [b for b in doc_blocks(block.doc)
          if b.line < block.line and b.not_run is None]
  assert runs, f"{block.id}: '# after the block above' but none runs above"
  return runs[-1]


# -------------------------------------------------------------- running


@functools.lru_cache(maxsize=None)
def _python_dir() -> pathlib.Path:
  """A directory whose ``python`` is this interpreter, for PATH."""
  bin_dir = pathlib.Path(tempfile.mkdtemp(prefix="docs_bin_"))
  # A script, not a link: a virtual environment's interpreter finds its
  # environment from the path it is started by.
  python = bin_dir / "python"
  python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
  python.chmod(0o755)
  return bin_dir


def _env() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("PYTEST_", "XLA_", "ZERO_JAX_"))}
  env.update(
      PATH=os.pathsep.join([str(_python_dir()), env.get("PATH", "")]),
      PYTHONPATH=os.pathsep.join(
          [str(_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
      JAX_PLATFORMS="cpu", XLA_FLAGS=_XLA_FLAGS, PYTHONUNBUFFERED="1")
  return env


def _fresh_dir(tmp: pathlib.Path) -> pathlib.Path:
  """A directory that looks like the repository root: a link to each
  top-level entry."""
  for entry in _ROOT.iterdir():
    if not entry.name.startswith("."):
      (tmp / entry.name).symlink_to(entry)
  return tmp


def _commands(text: str) -> list[str]:
  """A shell block's commands: continuation lines joined, comments out."""
  return [c for c in text.replace("\\\n", " ").splitlines()
          if c.strip() and not c.lstrip().startswith("#")]


def _source(block: DocBlock) -> str:
  """The block's text, after those it continues."""
  if _CONTINUES.match(block.first):
    before = _previous(block)
    assert before.kind == block.kind == "python", (
        f"{block.id}: only a python block continues a python block")
    return _source(before) + "\n" + block.text
  return block.text


def _run_one(block: DocBlock, cwd: pathlib.Path) -> None:
  if block.kind == "python":
    name = block.file_name or f"block_{block.line}.py"
    (cwd / name).write_text(_source(block), encoding="utf-8")
    commands = [[sys.executable, name]]
  else:
    commands = [["bash", "-c", c] for c in _commands(block.text)]
  for command in commands:
    out = subprocess.run(command, cwd=cwd, env=_env(), capture_output=True,
                         text=True, timeout=_TIMEOUT_S)
    assert out.returncode == 0, (
        f"{block.id}: {command[-1]} exited {out.returncode}\n"
        f"{out.stdout[-4000:]}\n{out.stderr[-4000:]}")


# Where each block ran, for the blocks that run after it.
_RAN: dict[str, pathlib.Path] = {}


def _start_dir(block: DocBlock, tmp: pathlib.Path) -> pathlib.Path:
  """A new directory as ``block`` finds it: after the block it follows, or
  as the block it continues found it, or fresh."""
  cwd = pathlib.Path(tempfile.mkdtemp(
      prefix=block.id.replace("/", "_").replace(":", "_") + "_", dir=tmp))
  if _AFTER.match(block.first):
    shutil.copytree(run_block(_previous(block), tmp), cwd, symlinks=True,
                    dirs_exist_ok=True)
  elif _CONTINUES.match(block.first):
    shutil.copytree(_start_dir(_previous(block), tmp), cwd, symlinks=True,
                    dirs_exist_ok=True)
  else:
    _fresh_dir(cwd)
  return cwd


def run_block(block: DocBlock, tmp: pathlib.Path) -> pathlib.Path:
  """Runs ``block`` (after the blocks it follows) and returns its
  directory."""
  if block.id not in _RAN:
    cwd = _start_dir(block, tmp)
    _run_one(block, cwd)
    _RAN[block.id] = cwd
  return _RAN[block.id]


# ---------------------------------------------------------------- tests


_BLOCKS = _all_blocks()


@pytest.mark.parametrize("block", _BLOCKS, ids=[b.id for b in _BLOCKS])
def test_the_block_runs_as_written(block, tmp_path_factory):
  reason = block.not_run
  if reason is not None:
    # Not run: the reader sees why, and the reason names something.
    assert len(reason.split()) >= 2, (
        f"{block.id}: the not-run marker must say why: {block.first!r}")
    return
  if _GPU_COMPILE.match(block.first) and not _gpu.AVAILABLE:
    pytest.skip("JAX's CUDA plugin is not installed (a missing backend)")
  tmp = tmp_path_factory.getbasetemp() / "docs_run"
  tmp.mkdir(exist_ok=True)
  run_block(block, tmp)


def test_every_runnable_block_is_run_or_says_why():
  # Every python and shell block is collected above, so each either runs
  # or carries the marker with a reason; a block in another language must
  # not hide Python or shell code from the test.
  for doc in _docs():
    for b in _blocks(doc.read_text(encoding="utf-8")):
      if b.lang in _RUNNABLE:
        continue
      where = f"{doc.relative_to(_ROOT).as_posix()}:{b.line}"
      assert b.lang in ("", "text", "json", "toml"), (
          f"{where}: a {b.lang!r} block: write python, bash or sh so that "
          "the docs test runs it")
      assert not re.search(r"^\s*(python|pip|import|from \w+ import) ",
                           b.text, re.M), (
          f"{where}: code in a block without a language; mark it python "
          "or bash")


def test_the_markers_are_read_as_the_module_says(tmp_path):
  doc = tmp_path / "x.md"
  doc.write_text(
      "```bash\n# not run by the docs test: needs a GPU\nnvidia-smi\n```\n"
      "```bash\n# not run by the docs test\nls\n```\n"
      "```python\n# train.py\nprint(1)\n```\n"
      "```sh\n# after the block above\npython train.py\n```\n"
      "```python\n# continues the block above\nprint(2)\n```\n"
      "```\npython not_code.py\n```\n", encoding="utf-8")
  got = doc_blocks(doc)
  assert [(b.kind, b.line) for b in got] == [
      ("shell", 2), ("shell", 6), ("python", 10), ("shell", 14),
      ("python", 18)]
  assert got[0].not_run == "needs a GPU"
  assert got[1].not_run == ""  # (the test above fails it: no reason)
  assert got[2].file_name == "train.py" and got[2].not_run is None
  assert _AFTER.match(got[3].first)
  assert _commands("a \\\n  b\n# c\n\nd\n") == ["a    b", "d"]
