"""Every zero_jax name, command, path and link the README and docs/ show
exists, and every public name of a subpackage (its ``__all__``) is one the
README or docs/ show.

The docs' Python (fenced ``python`` blocks, and inline code that parses as
Python) is read with ``ast``: each ``import zero_jax as zj`` / ``zj.<name>``
chain, ``from zero_jax import <name>`` and ``from zero_jax.<pkg> import
<name>`` is resolved against the package, and a private name (``_x``) is
an error: the docs show the API. Every ``python -m zero_jax.<module>`` and
``python <dir>/<file>.py`` command must name a module or file that exists,
and so must every repository path in inline code and every relative link
(with its heading, if it names one); every ``pip install -e ".[extra]"``
an extra of pyproject.toml. The README's quick start is the demo and the
test command CI runs, within its first 40 lines of at most 250, and its
"Use" example runs as written, on 8 CPU devices by its own line.
tests/test_docs_run.py runs every block.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys
import tomllib
import types
from typing import Any

import pytest

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_PACKAGE = "zero_jax"
# Names every snippet may use without importing them, as the docs write
# them: ``zj`` is ``import zero_jax as zj``.
_IMPLICIT = {"zj": _PACKAGE, _PACKAGE: _PACKAGE}


def _docs() -> list[pathlib.Path]:
  return [_ROOT / "README.md", *sorted((_ROOT / "docs").glob("*.md"))]


def _ids(paths: list[pathlib.Path]) -> list[str]:
  return [p.relative_to(_ROOT).as_posix() for p in paths]


# ------------------------------------------------------------ reading docs


_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)


@dataclasses.dataclass(frozen=True)
class Block:
  """A fenced code block: its language, text and first line."""

  lang: str
  text: str
  line: int


def _blocks(text: str) -> list[Block]:
  return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 2)
          for m in _FENCE.finditer(text)]


def _prose(text: str) -> str:
  """The text outside fenced blocks."""
  return _FENCE.sub("", text)


def _inline_code(text: str) -> list[str]:
  """Inline code spans of the prose, a span's line breaks as spaces."""
  return [" ".join(m.group(1).split())
          for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", _prose(text))]


def _commands(text: str) -> list[str]:
  """Shell commands: each line of a bash/sh block (continuation lines
  joined) and each inline code span."""
  out = []
  for block in _blocks(text):
    if block.lang in ("bash", "sh", "shell", "console"):
      out += [c for c in block.text.replace("\\\n", " ").splitlines()
              if c.strip() and not c.lstrip().startswith("#")]
  return out + _inline_code(text)


# ----------------------------------------------------- resolving names


@dataclasses.dataclass(frozen=True)
class Missing:
  """A name a doc uses that the package does not have."""

  name: str
  why: str

  def __str__(self) -> str:
    return f"{self.name}: {self.why}"


def _attr(obj: Any, name: str, shown: str) -> tuple[Any, Missing | None]:
  """``obj.name``, or a submodule of that name (``zero_jax.estimate``, an
  entry module, is no attribute until imported)."""
  if name.startswith("_") and not name.endswith("__"):
    return None, Missing(shown, f"{name!r} is private: docs show the API")
  try:
    return getattr(obj, name), None
  except AttributeError:
    pass
  if isinstance(obj, types.ModuleType) and importlib.util.find_spec(
      f"{obj.__name__}.{name}") is not None:
    return importlib.import_module(f"{obj.__name__}.{name}"), None
  return None, Missing(shown, f"{_describe(obj)} has no attribute {name!r}")


def _describe(obj: Any) -> str:
  if isinstance(obj, types.ModuleType):
    return f"module {obj.__name__}"
  return f"{getattr(obj, '__qualname__', type(obj).__name__)}"


def _import(module: str) -> tuple[Any, Missing | None]:
  if any(p.startswith("_") for p in module.split(".")):
    return None, Missing(module, "a private module: docs show the API")
  try:
    return importlib.import_module(module), None
  except ModuleNotFoundError as e:
    return None, Missing(module, f"no module ({e})")


def _chain(node: ast.expr) -> list[str] | None:
  """``a.b.c`` as ``["a", "b", "c"]``; None for anything else."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if not isinstance(node, ast.Name):
    return None
  return [node.id, *reversed(parts)]


def _resolve_chain(obj: Any, root: str, attrs: list[str]) -> Missing | None:
  """Follows ``attrs`` from ``obj`` through modules and classes (an
  instance's attributes are not checked: docs name them on variables)."""
  shown = root
  for name in attrs:
    if not (isinstance(obj, types.ModuleType) or inspect.isclass(obj)):
      return None
    shown += f".{name}"
    obj, missing = _attr(obj, name, shown)
    if missing:
      return missing
  return None


def missing_names(tree: ast.AST) -> list[Missing]:
  """The zero_jax names ``tree`` uses that do not exist.

  ``zj`` and ``zero_jax`` are bound to the package unless the code binds
  them itself; imports of zero_jax (``import zero_jax.x as y``, ``from
  zero_jax[.x] import y [as z]``) bind more names, each checked where it is
  imported. Every ``name.attr...`` chain rooted at a bound name is then
  followed through modules and classes.
  """
  bound: dict[str, Any] = {}
  out: list[Missing] = []
  for alias, module in _IMPLICIT.items():
    bound[alias] = importlib.import_module(module)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.split(".")[0] != _PACKAGE:
          continue
        mod, missing = _import(a.name)
        if missing:
          out.append(missing)
        elif a.asname:
          bound[a.asname] = mod
    elif (isinstance(node, ast.ImportFrom) and not node.level and
          node.module and node.module.split(".")[0] == _PACKAGE):
      mod, missing = _import(node.module)
      if missing:
        out.append(missing)
        continue
      for a in node.names:
        if a.name == "*":
          continue
        value, missing = _attr(mod, a.name, f"{node.module}.{a.name}")
        if missing:
          out.append(missing)
        else:
          bound[a.asname or a.name] = value
  seen = set()
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute):
      continue
    chain = _chain(node)
    if not chain or chain[0] not in bound or tuple(chain) in seen:
      continue
    seen.add(tuple(chain))
    missing = _resolve_chain(bound[chain[0]], chain[0], chain[1:])
    if missing:
      out.append(missing)
  return sorted(set(out), key=str)


def missing_in_doc(text: str) -> list[str]:
  """Problems with the Python of one doc: blocks that do not parse, and
  zero_jax names (in blocks and in inline code) that do not exist."""
  out = []
  for block in _blocks(text):
    if block.lang != "python":
      continue
    try:
      tree = ast.parse(block.text)
    except SyntaxError as e:
      out.append(f"python block at line {block.line} does not parse: {e}")
      continue
    out += [f"python block at line {block.line}: {m}"
            for m in missing_names(tree)]
  for span in _inline_code(text):
    if not re.search(r"\b(zj|zero_jax)\.", span):
      continue
    try:
      tree = ast.parse(span, mode="eval")
    except SyntaxError:
      continue  # (not Python: a command, a path, a table cell)
    out += [f"`{span}`: {m}" for m in missing_names(tree)]
  return out


def missing_targets(text: str, here: pathlib.Path) -> list[str]:
  """Commands and links of one doc that name nothing.

  ``python -m zero_jax.<module>`` must be a module of the package;
  ``python ... <dir>/<file>.py`` (the script, or a path among its
  arguments, as the launcher takes one) a file of the repository; a
  relative link a file beside the doc; ``pip install -e ".[x]"`` an extra
  of pyproject.toml.
  """
  out = []
  extras = tomllib.loads((_ROOT / "pyproject.toml").read_text())[
      "project"]["optional-dependencies"]
  for command in _commands(text):
    for call in re.split(r"&&|;|\|", command):
      words = call.split()
      if "python" not in words:
        continue
      args = words[words.index("python") + 1:]
      if args[:1] == ["-m"] and len(args) > 1:
        module = args[1]
        if (module.split(".")[0] == _PACKAGE and
            importlib.util.find_spec(module) is None):
          out.append(f"`{command}`: no module {module}")
      for word in args:
        path = word.split("=")[-1].strip("'\"`")
        if "/" in path and path.endswith(".py") and not path.startswith(
            ("/", "$")) and not (_ROOT / path).is_file():
          out.append(f"`{command}`: no file {path}")
    for extra in re.findall(r'pip install -e "?\.\[([\w,-]+)\]', command):
      for name in extra.split(","):
        if name not in extras:
          out.append(f"`{command}`: pyproject.toml has no extra {name!r}")
  for span in _inline_code(text):
    # A repository path on its own (`tests/train/test_bad_input.py`).
    if (re.fullmatch(r"[\w.-]+(/[\w.-]+)+\.(py|md|json|toml|txtpb|png)",
                     span) and not (_ROOT / span).is_file()):
      out.append(f"`{span}`: no such file in the repository")
  for target in re.findall(r"\]\(([^)\s]+)\)", _prose(text)):
    if re.match(r"[a-z]+:", target):
      continue  # (a web address)
    path, _, anchor = target.partition("#")
    file = here.parent / path if path else here
    if not file.exists():
      out.append(f"link ({target}): no {path} beside "
                 f"{here.relative_to(_ROOT).as_posix()}")
    elif anchor and file.suffix == ".md" and anchor not in _anchors(
        file.read_text(encoding="utf-8")):
      out.append(f"link ({target}): {path or 'this page'} has no heading "
                 f"#{anchor}")
  return out


def _anchors(text: str) -> set[str]:
  """The anchors of a markdown page's headings, as GitHub makes them."""
  out = set()
  for m in re.finditer(r"^#+\s+(.*?)\s*$", _prose(text), re.M):
    slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
    out.add(slug)
  return out


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("doc", _docs(), ids=_ids(_docs()))
def test_every_zero_jax_name_in_the_docs_exists(doc):
  problems = missing_in_doc(doc.read_text(encoding="utf-8"))
  assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", _docs(), ids=_ids(_docs()))
def test_every_command_and_link_in_the_docs_names_something(doc):
  problems = missing_targets(doc.read_text(encoding="utf-8"), doc)
  assert not problems, "\n".join(problems)


def test_the_checks_catch_names_and_paths_that_do_not_exist():
  doc = """
```python
import zero_jax as zj
from zero_jax import aot
from zero_jax.analysis import gpu_mesh, not_a_name
from zero_jax.nowhere import x
from zero_jax.layout._plan import plan_leaf
zj.analysis.gpu_mesh("h100", 8)
zj.distributed.initialize()
zj.Plan(params)
zj.ZeroConfig.from_deepspeed("ds.json")
zj.distributed.no_such_function()
```
Inline: `zj.remat_policy("full")`, `zero_jax.memory.comm_in_psi` and
`zj.train._engine.Engine` but `zj.from_deepspeed(path)` and `zero_jax.launch`.

```bash
python -m zero_jax.estimate --params 1e9
python -m zero_jax.aot
PYTHONPATH=. python benchmarks/gpu_bench.py
python -m zero_jax.launch --nproc 2 examples/train_gpt.py
pip install -e ".[nope]"
```
See [x](no_such_file.md), [y](usage.md#no-such-heading),
`tests/test_estimate.py` and
`python experiments/no_such_script.py`.
"""
  names = missing_in_doc(doc)
  for bad in ("zero_jax.aot", "zero_jax.analysis.not_a_name",
              "zero_jax.nowhere", "zj.Plan", "zj.ZeroConfig.from_deepspeed",
              "zj.distributed.no_such_function", "zj.remat_policy",
              "zero_jax.memory", "zj.train._engine", "zero_jax.layout._plan"):
    assert any(f"{bad}:" in p for p in names), (bad, names)
  assert len(names) == 10, names
  targets = missing_targets(doc, _ROOT / "docs" / "example.md")
  for bad in ("no module zero_jax.aot", "no file benchmarks/gpu_bench.py",
              "no file examples/train_gpt.py", "no extra 'nope'",
              "no no_such_file.md", "no file experiments/no_such_script.py",
              "`tests/test_estimate.py`: no such file",
              "usage.md has no heading #no-such-heading"):
    assert any(bad in p for p in targets), (bad, targets)
  assert len(targets) == 8, targets


# ---------------------------------------------------- the documented surface


def exported(init: pathlib.Path) -> list[str]:
  """The names of an ``__init__.py``'s ``__all__``, read from its source
  (nothing is imported)."""
  for node in ast.parse(init.read_text(encoding="utf-8")).body:
    if isinstance(node, ast.Assign) and any(
        getattr(t, "id", None) == "__all__" for t in node.targets):
      return list(ast.literal_eval(node.value))
  return []


def undocumented(names: list[str], text: str) -> list[str]:
  """The names of ``names`` that ``text`` never mentions as a word."""
  return [n for n in names if not re.search(rf"\b{re.escape(n)}\b", text)]


def test_every_public_name_is_in_the_docs():
  """A subpackage's ``__all__`` is what a user calls (the package itself
  imports an internal from its private module, as optax's ``_src``), so
  the README or a page of docs/ names each of its names; and each name of
  the top level's curated list is one of them."""
  text = "\n".join(p.read_text(encoding="utf-8") for p in _docs())
  inits = sorted((_ROOT / _PACKAGE).glob("*/__init__.py"))
  bad = [f"zero_jax.{init.parent.name}.{name}" for init in inits
         for name in undocumented(exported(init), text)]
  assert not bad, (
      f"public but in no doc (README.md, docs/*.md): {bad}; name each in "
      "the doc of its topic, or drop it from __all__ and import it from "
      "its private module")
  top = ast.parse((_ROOT / _PACKAGE / "__init__.py").read_text(
      encoding="utf-8"))
  names = next(ast.literal_eval(n.value) for n in top.body
               if isinstance(n, ast.Assign) and
               getattr(n.targets[0], "id", None) == "_NAMES")
  outside = [f"{name} ({package})" for name, package in names.items()
             if name not in exported(_ROOT / _PACKAGE / package /
                                     "__init__.py")]
  assert not outside, f"zero_jax's names not in their __all__: {outside}"


def test_the_surface_check_matches_whole_words():
  text = "`zj.layout.plan_leaf(shape, n, stage, m)` and a Plan's leaves"
  assert undocumented(["plan_leaf", "Plan", "LeafPlan", "plan"],
                      text) == ["LeafPlan", "plan"]


def _section(text: str, heading: str) -> str:
  m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text,
                re.M | re.S)
  assert m, f"README.md has no '## {heading}' section"
  return m.group(1)


def test_the_quick_start_is_the_two_commands_ci_runs():
  readme = (_ROOT / "README.md").read_text(encoding="utf-8")
  (block,) = [b for b in _blocks(_section(readme, "Quick start"))]
  # The block's first line tells the docs test (tests/test_docs_run.py)
  # not to run it, and why: CI runs both commands.
  marker, *commands = block.text.splitlines()
  assert marker.startswith("# not run by the docs test: ") and "CI" in (
      marker), marker
  assert commands == [
      "pip install -e . && python experiments/train_gpt.py",
      'pip install -e ".[test]" && python -m pytest -q -n 2 tests'], commands
  ci = (_ROOT / ".ci" / "run").read_text(encoding="utf-8")
  assert commands[1] in ci, "the README's test command is not .ci/run's"


def test_the_readme_is_short_with_the_quick_start_on_its_first_screen():
  # What it is, how to run it, what it gives; each table's notes and the
  # command behind each figure are in docs/ (docs/results.md).
  lines = (_ROOT / "README.md").read_text(encoding="utf-8").splitlines()
  assert len(lines) <= 250, (
      f"README.md has {len(lines)} lines, at most 250: move prose to docs/")
  assert "## Quick start" in lines[:40], "the quick start is not in the " \
      "README's first 40 lines"


def test_the_readme_use_example_runs_as_written(tmp_path):
  readme = (_ROOT / "README.md").read_text(encoding="utf-8")
  blocks = [b for b in _blocks(_section(readme, "Use"))
            if b.lang == "python"]
  assert blocks, "README.md's Use section has no python block"
  script = tmp_path / "use.py"
  script.write_text(blocks[0].text, encoding="utf-8")
  # No device count forced: the example's own line gives the reader
  # without an accelerator 8 CPU devices. The package as this suite
  # imports it (installed, or on PYTHONPATH), run from outside the
  # repository.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      [str(_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
  out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "ZeRO stage 3 over 8 device(s)" in out.stdout, out.stdout[:2000]
  # Ten steps, each printing its loss.
  losses = [float(line) for line in out.stdout.splitlines()
            if re.fullmatch(r"-?\d+\.\d+(e-?\d+)?", line.strip())]
  assert len(losses) == 10, out.stdout
  assert all(0 < x < 10 for x in losses), losses
