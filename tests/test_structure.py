"""Cheap checks on the code's shape: module sizes, import cycles, layering.

They read source files only (nothing is imported or run), so they take
milliseconds.
"""

from __future__ import annotations

import ast
import pathlib
import re

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_PACKAGE = _ROOT / "zero_jax"
_MAX_LINES = 500
_MAX_ENGINE_LINES = 400
# Directories of scripts that may use the tests' helpers the other way
# round only: tests must not import them, nor they the tests.
_SCRIPT_DIRS = ("experiments", "benchmarks", "examples")


def _lines(path: pathlib.Path) -> int:
  return len(path.read_text(encoding="utf-8").splitlines())


def _modules() -> dict[str, pathlib.Path]:
  """``zero_jax.x`` -> its file, for every module of the package."""
  out = {}
  for path in sorted(_PACKAGE.rglob("*.py")):
    parts = path.relative_to(_ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def test_no_module_is_longer_than_500_lines():
  long = {name: n for name, path in _modules().items()
          if (n := _lines(path)) > _MAX_LINES}
  assert not long, (f"modules over {_MAX_LINES} lines (split them by "
                    f"role): {long}")


def test_engine_is_at_most_400_lines():
  n = _lines(_PACKAGE / "train" / "_engine.py")
  assert n <= _MAX_ENGINE_LINES, (
      f"zero_jax/train/_engine.py has {n} lines, more than {_MAX_ENGINE_LINES}")


def _is_type_checking(test: ast.expr) -> bool:
  return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or
          (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _module_level_imports(tree: ast.Module) -> list[ast.stmt]:
  """The import statements run at import time: at the top level or inside
  top-level ``if``/``try`` blocks, not in functions or classes, nor under
  ``if TYPE_CHECKING:``."""
  out = []
  stack = list(tree.body)
  while stack:
    node = stack.pop()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      out.append(node)
    elif isinstance(node, ast.If):
      if not _is_type_checking(node.test):
        stack.extend(node.body)
      stack.extend(node.orelse)
    elif isinstance(node, ast.Try):
      for block in (node.body, node.orelse, node.finalbody,
                    *(h.body for h in node.handlers)):
        stack.extend(block)
  return out


def _imported(module: str, package: str, node: ast.stmt,
              known: set[str]) -> set[str]:
  """The package modules ``node`` (in ``module``, of ``package``)
  imports."""
  if isinstance(node, ast.Import):
    names = [a.name for a in node.names]
  else:
    base = node.module or ""
    if node.level:  # relative: from ``package`` up level - 1
      parts = package.split(".")[:len(package.split(".")) - node.level + 1]
      base = ".".join(parts + ([base] if base else []))
    # ``from zero_jax import x`` imports the module zero_jax.x if there is
    # one, else a name of zero_jax (its __init__).
    names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
             for a in node.names]
  out = set()
  for name in names:
    while name and name not in known:
      name = name.rpartition(".")[0]
    if name and name != module:
      out.add(name)
  return out


def _import_graph() -> dict[str, set[str]]:
  modules = _modules()
  known = set(modules)
  graph = {}
  for name, path in modules.items():
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    graph[name] = set().union(*(_imported(name, package, node, known)
                                for node in _module_level_imports(tree)))
  return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """A cycle of ``graph`` as a list of nodes (first == last), or None."""
  state: dict[str, int] = {}  # 1: on the path, 2: done
  path: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state and (cycle := visit(nxt)):
        return cycle
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state and (cycle := visit(node)):
      return cycle
  return None


def test_no_import_cycles():
  # The package's __init__ imports its modules to re-export names; a module
  # importing ``zero_jax`` itself would be a cycle through it, and is one.
  cycle = _find_cycle(_import_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
  assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [
      "a", "b", "c", "a"]
  assert _find_cycle({"a": {"b"}, "b": set()}) is None


def _imports_of(path: pathlib.Path) -> set[str]:
  """Top-level names of every module ``path`` imports (anywhere in it),
  plus what ``sys.path`` tricks import by a plain name in a string."""
  source = path.read_text(encoding="utf-8")
  out = set()
  for node in ast.walk(ast.parse(source, str(path))):
    if isinstance(node, ast.Import):
      out |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      out.add(node.module.split(".")[0])
  # (Imports in code strings run by subprocesses, e.g. "import tests.x".)
  out |= set(re.findall(r"\b(?:from|import)\s+([A-Za-z_]\w*)", source)) & {
      "tests", *_SCRIPT_DIRS}
  return out


def _script_modules(directory: str) -> set[str]:
  """The names a script directory's files import as once it is put on
  ``sys.path`` (``import gpu_bench`` after inserting experiments/)."""
  return {p.stem for p in (_ROOT / directory).glob("*.py")}


def test_tests_and_scripts_do_not_import_each_other():
  bad = []
  for path in sorted((_ROOT / "tests").rglob("*.py")):
    imports = _imports_of(path)
    for directory in _SCRIPT_DIRS:
      names = imports & ({directory} | _script_modules(directory))
      for name in sorted(names):
        bad.append(f"{path.relative_to(_ROOT)} imports {name} "
                   f"({directory}/)")
  for directory in _SCRIPT_DIRS:
    for path in sorted((_ROOT / directory).rglob("*.py")):
      if "tests" in _imports_of(path):
        bad.append(f"{path.relative_to(_ROOT)} imports tests")
  assert not bad, "; ".join(bad)
