"""What compiling for GPUs does to the user's environment, and when.

Without a GPU, JAX's CUDA plugin starts only if
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` is set when JAX's backends start. The
library sets it only when asked for compile-only GPUs, and only before the
backends start; importing it sets nothing. Each check runs in a fresh
interpreter without ``JAX_PLATFORMS`` (which this one sets to ``cpu``, and
with which the plugin needs no variable) and without the variable; one
interpreter for each start (what it checks after the first call to JAX
needs a fresh one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests._gpu import compiles_for_gpus

pytestmark = compiles_for_gpus

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_VAR = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
_H100 = "NVIDIA H100 80GB HBM3"


def _child(code: str, **env_extra: str) -> dict:
  """Runs ``code`` in a fresh interpreter; the JSON of its last line."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", _VAR)}
  env["PYTHONPATH"] = _ROOT
  env.update(env_extra)
  out = subprocess.run([sys.executable, "-c", code], env=env, cwd=_ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-4000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_changes_no_variable_and_asking_for_gpus_first_sets_it():
  # One interpreter: the imports, then the reference GPT compiled as its
  # first call. compile_gpt imports the model and the engine before it asks
  # for the mesh (gpu_mesh): neither may touch JAX's devices on import.
  r = _child(f"""
import json, os
start = dict(os.environ)
import zero_jax
top = dict(os.environ)
import jax  # (JAX's own import sets its logging variables: compared after)
with_jax = dict(os.environ)
import zero_jax.analysis
import zero_jax.models
from zero_jax import models
imported = {{"top": top == start, "analysis": dict(os.environ) == with_jax,
             "var": {_VAR!r} in os.environ}}
before = os.environ.get({_VAR!r})
engine, c = models.compile_gpt("h100", 2, 3, layers=1, hidden=32, heads=2,
                               vocab=32, seq_len=8, micro_batch=1)
print(json.dumps({{"imported": imported, "before": before,
                  "after": os.environ.get({_VAR!r}),
                  "kinds": [d.device_kind for d in engine.mesh.devices.flat],
                  "gathered": c.collective_bytes("all-gather")}}))
""")
  assert r.pop("gathered") > 0, r
  assert r == {"imported": {"top": True, "analysis": True, "var": False},
               "before": None, "after": "1", "kinds": [_H100, _H100]}, r


def test_a_value_the_user_set_is_left_as_it_is():
  r = _child(f"""
import json, os
from zero_jax import analysis
analysis.gpu_mesh("h100", 2)
print(json.dumps(os.environ.get({_VAR!r})))
""", **{_VAR: "yes"})
  assert r == "yes"


def test_asking_after_the_backends_started_names_the_fixes():
  r = _child(f"""
import json, os
import jax
from zero_jax import analysis
gpus = [d for d in jax.devices() if d.platform == "gpu"]
try:
  analysis.gpu_mesh("h100", 2)
  error = None
except RuntimeError as e:
  error = str(e)
print(json.dumps({{"gpus": len(gpus), "error": error,
                  "var": os.environ.get({_VAR!r})}}))
""")
  # Too late to set: the variable is left alone.
  assert r["var"] is None, r
  if r["gpus"]:
    # A real GPU passed the plugin's check: compile-only devices work.
    assert r["error"] is None, r
    return
  error = r["error"]
  assert error is not None, r
  assert "backends started" in error and "jax.devices()" in error, error
  for fix in (f"Set {_VAR}=1 in the environment before starting Python",
              "zero_jax.analysis.gpu_mesh()/gpu_devices() before anything "
              "touches JAX devices", "JAX_PLATFORMS=cpu"):
    assert fix in error, (fix, error)


def test_with_jax_platforms_cpu_no_variable_is_needed_after_the_backends():
  r = _child(f"""
import json, os
import jax
from zero_jax import analysis
jax.devices()
kinds = [d.device_kind for d in analysis.gpu_devices("h100", 2)]
print(json.dumps({{"kinds": kinds, "var": os.environ.get({_VAR!r})}}))
""", JAX_PLATFORMS="cpu")
  assert r == {"kinds": [_H100, _H100], "var": None}, r
