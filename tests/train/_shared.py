"""What several test files of tests/train build alike, built once per process.

Compiling dominates these tests (each engine compiles its init, step and
gather), so a reference run or a trained engine that more than one test
needs comes from here, cached: a file runs whole on one worker
(tests/conftest.py), so each is built once in a run.
"""

from __future__ import annotations

import functools
import itertools

from tests import _models as m

# Training steps of the GPT where a test compares it with single-device
# optax: enough that the optimizer state matters (Adam's moments, the
# momentum), and a third of the 10 of tests/_models (each step of the
# 8-device GPT costs as much to run as the MLP does to compile).
GPT_STEPS = 3
# The batches of a tests/_models model (and of its cached_reference).
MODEL_STEPS = 10


@functools.cache
def setup(model: str, steps: int):
  """(loss_fn, params, batches) of a tests/_models model, ``steps``
  batches (the first ``steps`` of any longer run)."""
  if model == "gpt":
    return m.gpt_setup(steps=steps)
  loss_fn, params, batches = m.MODELS[model]()
  assert len(batches) >= steps
  return loss_fn, params, batches[:steps]


@functools.cache
def reference(model: str, opt: str, steps: int):
  """Single-device optax over ``setup(model, steps)``: (losses, params)."""
  if steps == MODEL_STEPS:
    return m.cached_reference(model, opt)  # (shared with other files)
  loss_fn, params, batches = setup(model, steps)
  return m.train_reference(loss_fn, m.OPTIMIZERS[opt](m.LR_SCALE[model]),
                           params, batches)


def uncovered_pairs(cases, default) -> list:
  """The pairs of values (of any two positions of the case tuples) that
  some case of ``cases`` has and no case of ``default`` does: empty where
  ``default`` covers ``cases`` pairwise."""
  def pairs(case):
    return {(i, case[i], j, case[j])
            for i, j in itertools.combinations(range(len(case)), 2)}
  have = set().union(*map(pairs, default))
  return sorted(set().union(*map(pairs, cases)) - have, key=str)
