"""Steps that several analysis test files compile.

- ``gpt``/``step``: on the 8 CPU devices (test_memory_hlo.py,
  test_estimate.py). Each is built once per process; a file on another
  worker finds the same programs in the run's persistent compilation cache
  (they are CPU programs, which it keeps), so the two files compile them
  once between them.
- ``compile_gpt``: ``zero_jax.models.compile_gpt`` once per process for
  each distinct step, however its arguments are spelled. Programs compiled
  for GPUs are not kept by the persistent cache, so each would otherwise
  cost its whole compile again.
"""

import functools
import inspect

import optax

import zero_jax as zj
from tests import _models as m
from zero_jax import models

N = 8


@functools.cache
def gpt(n_layers: int = 4):
  """``(loss_fn, params, batch)``: the reference GPT, width 128, 16
  sequences of 16 tokens."""
  loss_fn, params, batches = m.gpt_setup(d_model=128, n_layers=n_layers,
                                         seq_len=16, batch=16, steps=1)
  return loss_fn, params, batches[0]


@functools.cache
def step(stage: int, n_layers: int = 4, replica: int = 1,
         compute_dtype: str | None = None, loss_scope: str = "global"):
  """``(engine, state, compiled)``: AdamW at ``stage`` on 8 devices
  (``replica`` groups), initialized and its step compiled for ``gpt``'s
  batch.

  Without prefetch, whose first and last layers are gathered and reduced
  twice (tests/layers/test_prefetch.py counts those).
  """
  loss_fn, params, batch = gpt(n_layers)
  mesh = (zj.make_mesh(num_devices=N) if replica == 1 else
          zj.make_mesh(num_devices=N, replica=replica))
  engine = zj.Engine(loss_fn, optax.adamw(1e-3),
                     zj.ZeroConfig(stage=stage, prefetch=False,
                                   compute_dtype=compute_dtype,
                                   loss_scope=loss_scope), mesh)
  state = engine.init(params)
  return engine, state, engine.step.lower(state, batch).compile()


_SIGNATURE = inspect.signature(models.compile_gpt)


def compile_gpt(*args, **kwargs):
  """``zero_jax.models.compile_gpt``, each distinct step compiled once:
  the same ``(engine, compiled)`` for the same arguments, defaults filled
  in (``overrides`` None and {} alike)."""
  bound = _SIGNATURE.bind(*args, **kwargs)
  bound.apply_defaults()
  arguments = dict(bound.arguments)
  arguments["overrides"] = tuple(sorted((arguments["overrides"] or
                                         {}).items()))
  return _compiled_gpt(tuple(sorted(arguments.items())))


@functools.cache
def _compiled_gpt(arguments):
  kwargs = dict(arguments)
  return models.compile_gpt(**{**kwargs,
                               "overrides": dict(kwargs["overrides"])})
