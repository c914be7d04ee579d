"""Tests, examples and benchmarks stay independent of each other.

Tests run the example and the benchmarks as scripts (subprocesses), never
import them; the scripts never import the tests. Only ``zero_jax`` is shared.
"""

import ast
import os

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _scripts(folder):
  path = os.path.join(_ROOT, folder)
  return sorted(os.path.join(path, f) for f in os.listdir(path)
                if f.endswith(".py"))


def _imports(path):
  """Top-level module names a file imports (absolute imports only)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and not node.level:
      names.add(node.module.split(".")[0])
  return names


def test_tests_do_not_import_examples_or_benchmarks():
  scripts = {os.path.basename(p)[:-3]
             for folder in ("examples", "benchmarks") for p in _scripts(folder)}
  for path in _scripts("tests"):
    bad = _imports(path) & (scripts | {"examples", "benchmarks"})
    assert not bad, f"{path} imports {sorted(bad)}: run it as a script"


def test_examples_and_benchmarks_do_not_import_tests():
  tests = {os.path.basename(p)[:-3] for p in _scripts("tests")} | {"tests"}
  for folder in ("examples", "benchmarks"):
    for path in _scripts(folder):
      bad = _imports(path) & tests
      assert not bad, f"{path} imports {sorted(bad)}"
