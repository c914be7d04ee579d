"""Checks on the code's shape: the top level, subpackages by role, module
names and sizes, imports and their layering, private attributes, repeated
code.

They read source files only (nothing is imported or run), so they take
milliseconds. What importing the package does is tests/test_import.py's.
"""

from __future__ import annotations

import ast
import hashlib
import pathlib
import re
from typing import Callable

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_PACKAGE = _ROOT / "zero_jax"
_MAX_LINES = 500
_MAX_ENGINE_LINES = 400
# Scripts that may use the tests' helpers the other way round only: tests
# must not import them, nor they the tests.
_SCRIPT_DIRS = ("experiments",)
# The subpackages in data-flow order: a module imports only from its own
# subpackage, from earlier ones, and from the top-level private helpers,
# inside its functions as much as at import time. (An earlier layer that
# must reach a later one offers a hook the later one registers with, as
# train's ``add_step_listener``.)
_LAYERS = ("config", "layout", "materialize", "layers", "offload", "train",
           "checkpoint", "distributed", "analysis", "metrics", "models")
# The top level's private helpers, shared by every subpackage: each a helper
# of its own (jax versions, value checks, devices, key paths), none a place
# that only dodges the layer order.
_HELPERS = ("_checks", "_compat", "_devices", "_paths")
# Private attributes of other objects that the package may read, and where:
# Python's own (os._exit is the documented exit without cleanup), and the
# internals of JAX and orbax, each confined to one module that a test ties
# to the installed versions.
_PRIVATE_READS = {
    "_exit": None, "_getframe": None,  # (os, sys: anywhere)
}
_PRIVATE_MODULES = ("zero_jax/_compat.py", "zero_jax/checkpoint/_orbax.py")


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


def _tree(path: pathlib.Path) -> ast.Module:
  return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _rel(path: pathlib.Path) -> str:
  return path.relative_to(_ROOT).as_posix()


# ------------------------------------------------------------- the top level


def test_the_top_level_is_what_the_design_card_names():
  top = {p.name for p in _ROOT.iterdir() if not p.name.startswith(".")}
  assert {"zero_jax", "experiments", "tests", "pyproject.toml",
          "README.md"} <= top
  assert not top & {"examples", "benchmarks"}, (
      "scripts live in experiments/ (the demo, its DeepSpeed config, the "
      "benchmarks and experiments/results/)")
  assert (_ROOT / "experiments" / "train_gpt.py").is_file()
  assert (_ROOT / "experiments" / "results").is_dir()


def test_subpackages_by_role_each_with_a_curated_api():
  packages = {p.parent.name for p in _PACKAGE.glob("*/__init__.py")}
  assert packages == set(_LAYERS)
  for name in _LAYERS:
    tree = _tree(_PACKAGE / name / "__init__.py")
    assert ast.get_docstring(tree), f"zero_jax/{name} has no docstring"
    exported = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == "__all__"
                        for t in n.targets)]
    assert exported, f"zero_jax/{name}/__init__.py has no __all__"
  # Private modules leave the curation to their package's __init__.
  for name, path in _modules().items():
    if path.stem.startswith("_") and path.stem != "__init__":
      assert "__all__" not in path.read_text(encoding="utf-8"), name
  # Every module in a subpackage is private, its __init__ the only door.
  public = [_rel(p) for p in _PACKAGE.glob("*/*.py")
            if not p.stem.startswith("_")]
  assert not public, f"public modules inside subpackages: {public}"


def test_no_module_name_is_another_plus_a_suffix():
  # (checkpoint.py beside checkpoint_files.py: a split that should have
  # been a subpackage.)
  bad = []
  for folder in sorted({p.parent for p in _PACKAGE.rglob("*.py")} |
                       {_PACKAGE}):
    names = sorted(p.stem for p in folder.glob("*.py")
                   if p.stem != "__init__")
    names += sorted(p.name for p in folder.iterdir()
                    if (p / "__init__.py").is_file())
    for a in names:
      for b in names:
        if a != b and b.startswith(a):
          bad.append(f"{_rel(folder)}: {a} / {b}")
  assert not bad, bad


def test_no_module_is_longer_than_500_lines():
  long = {name: n for name, path in _modules().items()
          if (n := _lines(path)) > _MAX_LINES}
  assert not long, (f"modules over {_MAX_LINES} lines (split them by "
                    f"role): {long}")


def test_the_engine_facade_is_at_most_400_lines():
  n = _lines(_PACKAGE / "train" / "_engine.py")
  assert n <= _MAX_ENGINE_LINES, (
      f"zero_jax/train/_engine.py has {n} lines, more than "
      f"{_MAX_ENGINE_LINES}: the engine is a facade over the layout")


# -------------------------------------------------------------------- imports


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


def _all_imports(tree: ast.Module) -> list[ast.stmt]:
  """Every import statement, at import time or inside a function or
  class, except under ``if TYPE_CHECKING:`` (which never runs)."""
  out = []
  stack: list[ast.AST] = list(tree.body)
  while stack:
    node = stack.pop()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      out.append(node)
    elif isinstance(node, ast.If) and _is_type_checking(node.test):
      stack.extend(node.orelse)
    else:
      stack.extend(ast.iter_child_nodes(node))
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


def _import_graph(imports: Callable[[ast.Module], list[ast.stmt]] =
                  _module_level_imports) -> dict[str, set[str]]:
  """Module -> the package modules it imports (at import time, or as
  ``imports`` collects them)."""
  modules = _modules()
  known = set(modules)
  graph = {}
  for name, path in modules.items():
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    graph[name] = set().union(*(_imported(name, package, node, known)
                                for node in imports(_tree(path))))
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
  # The top level loads its subpackages lazily, so only the subpackages'
  # own imports can make a cycle. (At import time: inside a subpackage a
  # function may import a module that imports its own, as offload's numba
  # kernels do on first use.)
  cycle = _find_cycle(_import_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
  assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [
      "a", "b", "c", "a"]
  assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_layer_check_sees_imports_inside_functions():
  tree = ast.parse(
      "import a\n"
      "def f():\n  import b\n"
      "class C:\n  def g(self):\n    from c import d\n"
      "if TYPE_CHECKING:\n  import e\nelse:\n  import f\n")
  names = lambda imports: sorted(
      a.name if isinstance(n, ast.Import) else n.module
      for n in imports(tree) for a in n.names)
  assert names(_all_imports) == ["a", "b", "c", "f"]
  assert names(_module_level_imports) == ["a", "f"]


def _layer(module: str) -> str | None:
  """The subpackage of ``zero_jax.pkg.mod`` (None at the top level)."""
  parts = module.split(".")
  return parts[1] if len(parts) > 2 or (
      len(parts) == 2 and parts[1] in _LAYERS) else None


def _public_names(package: str) -> set[str]:
  """The names in ``zero_jax/<package>/__init__.py``'s ``__all__``."""
  for node in _tree(_PACKAGE / package / "__init__.py").body:
    if isinstance(node, ast.Assign) and any(
        getattr(t, "id", None) == "__all__" for t in node.targets):
      return set(ast.literal_eval(node.value))
  return set()


def test_imports_follow_the_data_flow_and_public_doors():
  """A module imports its own subpackage's modules, the top-level helpers,
  and earlier subpackages: a name of their user surface (``__all__``)
  through their __init__, any other name from the private module that
  defines it (optax's ``_src`` layout: the __init__ is the user's door, not
  the package's own). Never a later subpackage, not even inside a
  function. The top level's entry modules (``python -m zero_jax.estimate``,
  ``zero_jax.launch``) are the user's code: public doors only."""
  bad = []
  for name, targets in _import_graph(_all_imports).items():
    own = _layer(name)
    for target in sorted(targets):
      there = _layer(target)
      if there is None:
        helper = target.rpartition(".")[2]
        if target != "zero_jax" and helper not in _HELPERS:
          bad.append(f"{name} imports {target}")
        continue
      if there == own:
        continue
      if own is None and target != f"zero_jax.{there}":
        bad.append(f"{name} imports {target}, private to zero_jax.{there}"
                   f" (import from zero_jax.{there})")
      if own is not None and _LAYERS.index(there) > _LAYERS.index(own):
        bad.append(f"{name} ({own}) imports {target}, a later layer")
  # A public name comes through its package's door, so that the user's
  # surface is the one the package itself uses.
  for name, path in _modules().items():
    own = _layer(name)
    for node in _all_imports(_tree(path)):
      if not isinstance(node, ast.ImportFrom) or node.level:
        continue
      parts = (node.module or "").split(".")
      if (len(parts) < 3 or parts[0] != "zero_jax" or parts[1] == own or
          parts[1] not in _LAYERS):
        continue
      for alias in node.names:
        if alias.name in _public_names(parts[1]):
          bad.append(f"{name} imports {alias.name} from {node.module}: "
                     f"public, import it from zero_jax.{parts[1]}")
  assert not bad, bad


def test_the_top_level_imports_nothing_but_the_standard_library():
  # (So that ``import zero_jax`` changes nothing: JAX itself sets
  # environment variables when it is imported.)
  tree = _tree(_PACKAGE / "__init__.py")
  names = {a.name.split(".")[0] if isinstance(n, ast.Import) else
           (n.module or "").split(".")[0]
           for n in _module_level_imports(tree) for a in n.names}
  assert names <= {"__future__", "importlib", "typing"}, names


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
        bad.append(f"{_rel(path)} imports {name} ({directory}/)")
  for directory in _SCRIPT_DIRS:
    for path in sorted((_ROOT / directory).rglob("*.py")):
      if "tests" in _imports_of(path):
        bad.append(f"{_rel(path)} imports tests")
  assert not bad, "; ".join(bad)


def test_scripts_use_only_the_public_api():
  bad = []
  for path in sorted((_ROOT / "experiments").rglob("*.py")):
    for node in ast.walk(_tree(path)):
      if isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module] + [f"{node.module}.{a.name}"
                                 for a in node.names]
      elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      else:
        continue
      for name in names:
        if name.startswith("zero_jax") and any(
            part.startswith("_") for part in name.split(".")):
          bad.append(f"{_rel(path)}:{node.lineno} imports {name}")
  assert not bad, bad


# --------------------------------------------------------------- privates


def test_no_module_reads_another_objects_private_attributes():
  """``x._name`` only on ``self``/``cls``: an engine, a checkpointer or a
  step function is used through its public API (no more
  ``engine._streamer``). JAX's and orbax's internals are read in one module
  each."""
  bad = []
  for path in sorted(_PACKAGE.rglob("*.py")):
    if _rel(path) in _PRIVATE_MODULES:
      continue
    for node in ast.walk(_tree(path)):
      if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
              and not node.attr.endswith("__")):
        continue
      if isinstance(node.value, ast.Name) and node.value.id in ("self",
                                                                "cls"):
        continue
      if node.attr in _PRIVATE_READS:
        continue
      bad.append(f"{_rel(path)}:{node.lineno}: {ast.unparse(node)}")
    for node in ast.walk(_tree(path)):
      if not isinstance(node, (ast.Import, ast.ImportFrom)):
        continue
      modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""])
      for module in modules:
        if (not module.startswith("zero_jax") and
            any(part.startswith("_") for part in module.split(".")[1:])):
          bad.append(f"{_rel(path)}:{node.lineno}: imports {module}")
  assert not bad, bad


def test_only_the_interception_module_assigns_a_class_call():
  """NNX blocks are run one at a time by wrapping their classes' __call__
  while a step is traced, in one module, confined to the tracing thread
  (tests/layers/test_intercept_threads.py runs it from several threads)."""
  sites = []
  for path in sorted(_PACKAGE.rglob("*.py")):
    for node in ast.walk(_tree(path)):
      if (isinstance(node, ast.Call) and getattr(node.func, "id", None) ==
          "setattr" and len(node.args) >= 2 and
          isinstance(node.args[1], ast.Constant) and
          node.args[1].value == "__call__"):
        sites.append(_rel(path))
      elif isinstance(node, ast.Assign) and any(
          isinstance(t, ast.Attribute) and t.attr == "__call__"
          for t in node.targets):
        sites.append(_rel(path))
  assert set(sites) <= {"zero_jax/layers/_intercept.py"}, sites


# ------------------------------------------------------------ repeated code


# A run of this many code lines that stands twice in the package is a
# repeat to fold (the project's duplicate finder's threshold).
_RUN = 6


def _code_lines(path: pathlib.Path) -> list[tuple[int, str]]:
  """``(line number, text)`` of the lines that count: not blank, not a
  comment, not an import, not lone punctuation, not inside a docstring;
  white space folded."""
  source = path.read_text(encoding="utf-8")
  skip = set()
  for node in ast.walk(ast.parse(source)):
    body = getattr(node, "body", None)
    if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)):
      skip.update(range(body[0].lineno, body[0].end_lineno + 1))
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      skip.update(range(node.lineno, node.end_lineno + 1))
  out = []
  for number, line in enumerate(source.splitlines(), 1):
    text = " ".join(line.split())
    if (number in skip or not text or text.startswith("#") or
        not re.search(r"\w", text)):
      continue
    out.append((number, text))
  return out


def _repeats(files: dict[str, list[tuple[int, str]]]) -> list[str]:
  """Places where a run of ``_RUN`` code lines stands a second time."""
  first: dict[str, str] = {}
  found = []
  for name, lines in sorted(files.items()):
    last = -_RUN
    for i in range(len(lines) - _RUN + 1):
      run = "\n".join(text for _, text in lines[i:i + _RUN])
      key = hashlib.sha1(run.encode()).hexdigest()
      here = f"{name}:{lines[i][0]}"
      if key in first and i >= last + _RUN:
        found.append(f"{here} repeats {first[key]}")
        last = i
      first.setdefault(key, here)
  return found


def test_no_block_of_code_is_repeated_in_the_package():
  files = {_rel(p): _code_lines(p) for p in sorted(_PACKAGE.rglob("*.py"))}
  repeats = _repeats(files)
  assert not repeats, repeats


def test_the_repeat_finder_finds_repeats():
  block = [(i, f"x{i} = f(y, {i})") for i in range(_RUN)]
  assert _repeats({"a.py": block, "b.py": block})
  assert not _repeats({"a.py": block,
                       "b.py": block[:_RUN - 1] + [(9, "other()")]})


# ---------------------------------------------------------- the config read

# The modules that may read a ZeroConfig's fields: the config's own, and
# the decision pass, whose frozen Decisions everything else reads.
_CONFIG_READERS = ("zero_jax/config/", "zero_jax/layout/_decide.py")
# Names a ZeroConfig goes by where it is read.
_CONFIG_NAMES = ("config", "cfg", "zero_config")


def _config_fields() -> set[str]:
  """Every name a ZeroConfig field is read by: its own fields, its
  sections' fields and their shorthand (the ``SHORTHAND`` tables of the
  section classes), and its two derived readers."""
  names = {"batch_sizes", "dynamic_loss_scale"}
  for path in (_PACKAGE / "config").glob("*.py"):
    for node in ast.walk(_tree(path)):
      if not isinstance(node, ast.ClassDef):
        continue
      for item in node.body:
        if (node.name == "ZeroConfig" and isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Name)):
          names.add(item.target.id)
        if (isinstance(item, ast.Assign) and isinstance(item.value, ast.Dict)
            and any(getattr(t, "id", None) == "SHORTHAND"
                    for t in item.targets)):
          for key, value in zip(item.value.keys, item.value.values):
            names.update(x.value for x in (key, value)
                         if isinstance(x, ast.Constant))
  return names


def test_only_the_decision_pass_reads_the_config():
  # A choice made from the config in two places drifts apart: the config
  # is read by zero_jax.layout.decide once, and the step, its strategies,
  # analysis and checkpoint read its Decisions.
  fields = _config_fields()
  assert {"stage", "offload", "offload_optimizer", "compute_dtype",
          "prefetch", "accum_steps"} <= fields
  bad = []
  for path in sorted(_PACKAGE.rglob("*.py")):
    if _rel(path).startswith(_CONFIG_READERS):
      continue
    for node in ast.walk(_tree(path)):
      if not (isinstance(node, ast.Attribute) and node.attr in fields):
        continue
      owner = node.value
      name = (owner.id if isinstance(owner, ast.Name) else
              owner.attr if isinstance(owner, ast.Attribute) else None)
      if name in _CONFIG_NAMES and ast.unparse(owner) != "jax.config":
        bad.append(f"{_rel(path)}:{node.lineno}: {ast.unparse(node)}")
  assert not bad, ("read the decisions (zero_jax.layout.decide), not the "
                   f"config: {bad}")


def test_the_train_step_is_typed_where_it_matters():
  # The step plan is what every train function takes: each takes it typed
  # (StepPlan), and its strategies are protocols, not Any.
  untyped = []
  for path in sorted((_PACKAGE / "train").glob("*.py")):
    for node in ast.walk(_tree(path)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        untyped += [f"{_rel(path)}:{node.lineno} {arg.arg}"
                    for arg in a.posonlyargs + a.args + a.kwonlyargs
                    if arg.arg in ("layout", "plan") and arg.annotation is None]
  assert not untyped, untyped
  tree = _tree(_PACKAGE / "train" / "_step_plan.py")
  plan = next(n for n in ast.walk(tree)
              if isinstance(n, ast.ClassDef) and n.name == "StepPlan")
  slots = {n.target.id: ast.unparse(n.annotation) for n in plan.body
           if isinstance(n, ast.AnnAssign)}
  assert slots["grads"] == "_grads.GradsStrategy", slots
  assert slots["update"] == "_update.UpdateStrategy", slots
