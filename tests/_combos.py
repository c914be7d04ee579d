"""Counts what the suite checks against single-device optax.

A pytest plugin, off unless asked for::

  python -m pytest -p tests._combos -n 2 tests

It records every distinct (stage, mesh, optimizer, compute dtype) whose
trained parameters a test compared with plain single-device optax
(``tests._models.train_reference``), and writes them, one JSON list per
process, to ``$ZERO_JAX_COMBOS`` (default ``combos``) with the process's
name appended; ``python -m tests._combos FILES...`` merges and counts them.

How a comparison is recognised, with no change to the tests: the results of
``train_reference`` are remembered by identity (cached references hand out
the same objects), as are the parameters ``Engine.gather_params`` returns;
``assert_matches`` or ``rel_err`` called with both counts that engine.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

_REFERENCES: set[int] = set()   # ids of reference results
_KEEP: list = []  # what the ids name, held so that no id is reused
_GATHERED: dict[int, tuple] = {}  # id(gathered params) -> combination
_SEEN: set[tuple] = set()


def optimizer_name(tx) -> str:
  """The optax factories an optimizer is built from, e.g. ``adamw`` as
  'add_decayed_weights+chain+scale_by_adam+scale_by_learning_rate'."""
  names, stack, seen = set(), [tx], set()
  while stack:
    obj = stack.pop()
    if id(obj) in seen:
      continue
    seen.add(id(obj))
    if callable(obj) and hasattr(obj, "__qualname__"):
      qual = obj.__qualname__
      if ".<locals>." in qual:
        names.add(qual.split(".<locals>.")[0])
      for cell in getattr(obj, "__closure__", None) or ():
        try:
          stack.append(cell.cell_contents)
        except ValueError:  # an empty cell
          pass
    elif isinstance(obj, (tuple, list)):
      stack.extend(obj)
    elif hasattr(obj, "update") and hasattr(obj, "init"):
      stack.extend((obj.init, obj.update))
  return "+".join(sorted(names)) or type(tx).__name__


def _combination(engine) -> tuple:
  cfg = engine.config
  mesh = ",".join(f"{k}={v}" for k, v in dict(engine.mesh.shape).items())
  return (int(cfg.stage), mesh, optimizer_name(engine.tx),
          str(cfg.compute_dtype or "float32"))


def _install():
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  from tests import _models  # pylint: disable=g-import-not-at-top

  reference, gather = _models.train_reference, zj.Engine.gather_params
  assert_matches, rel_err = _models.assert_matches, _models.rel_err

  def train_reference(*args, **kwargs):
    out = reference(*args, **kwargs)
    _KEEP.append(out)
    _REFERENCES.update({id(out[0]), id(out[1])})
    return out

  def gather_params(self, state):
    out = gather(self, state)
    _GATHERED[id(out)] = _combination(self)
    _KEEP.append(out)  # (ids stay unique while it lives)
    return out

  def note(params, ref_params):
    if id(ref_params) in _REFERENCES and id(params) in _GATHERED:
      _SEEN.add(_GATHERED[id(params)])

  def checked_assert_matches(losses, params, ref_losses, ref_params,
                             *args, **kwargs):
    note(params, ref_params)
    return assert_matches(losses, params, ref_losses, ref_params, *args,
                          **kwargs)

  def checked_rel_err(a, b):
    note(a, b)
    return rel_err(a, b)

  _models.train_reference = train_reference
  _models.assert_matches = checked_assert_matches
  _models.rel_err = checked_rel_err
  zj.Engine.gather_params = gather_params


def pytest_configure(config):
  del config
  _install()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
  del session
  path = (os.environ.get("ZERO_JAX_COMBOS", "combos") + "." +
          os.environ.get("PYTEST_XDIST_WORKER", "main") + ".json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(sorted(_SEEN), f)


def main(paths: list[str]) -> None:
  seen = set()
  for path in paths:
    with open(path, encoding="utf-8") as f:
      seen.update(tuple(c) for c in json.load(f))
  for c in sorted(seen):
    print(*c, sep="  ")
  print(f"{len(seen)} distinct (stage, mesh, optimizer, dtype) combinations")


if __name__ == "__main__":
  main(sys.argv[1:])
