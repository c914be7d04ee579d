"""What ``import zero_jax`` does to the user's process: nothing.

Each check runs in a fresh interpreter (this one has imported JAX already,
which sets environment variables of its own when imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Everything a library import could change in the process, before and
# after: environment, threads, signal handlers, modules loaded.
_PROBE = """
import json, os, signal, sys, threading
SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")
def snapshot():
  return {"environ": dict(os.environ), "threads": threading.active_count(),
          "signals": {s: repr(signal.getsignal(getattr(signal, s)))
                      for s in SIGNALS},
          "excepthook": repr(sys.excepthook), "exit": repr(sys.exit)}
before = snapshot()
import zero_jax
after = snapshot()
# (faulthandler's own registrations sit below Python's signal table:
# getsignal cannot see them, unregister can.)
import faulthandler
after["stack_dump"] = faulthandler.unregister(signal.SIGUSR1)
before["stack_dump"] = False
print(json.dumps({"before": before, "after": after,
                  "jax": "jax" in sys.modules,
                  "loaded": sorted(m for m in sys.modules
                                   if m.startswith("zero_jax"))}))
"""


def _probe(env_extra: dict[str, str] | None = None) -> dict:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_", "XLA_", "TF_", "TPU_", "ZERO_JAX_"))}
  env["PYTHONPATH"] = _ROOT
  env.update(env_extra or {})
  out = subprocess.run([sys.executable, "-c", _PROBE], env=env,
                       capture_output=True, text=True, timeout=120,
                       check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_zero_jax_changes_nothing_in_the_process():
  r = _probe()
  assert r["after"]["environ"] == r["before"]["environ"]
  assert r["after"]["threads"] == r["before"]["threads"]
  assert r["after"]["signals"] == r["before"]["signals"]
  assert r["after"]["excepthook"] == r["before"]["excepthook"]
  assert r["after"]["exit"] == r["before"]["exit"]
  # Nothing else is loaded until used, not even JAX (whose import sets
  # TF_CPP_MIN_LOG_LEVEL and TPU_SKIP_MDS_QUERY).
  assert not r["jax"]
  assert r["loaded"] == ["zero_jax"]


def test_under_the_launchers_watchdog_importing_registers_nothing(tmp_path):
  # The launcher names a heartbeat file; the process's stack dump and the
  # file are the launcher's runner's to set up, never an import's.
  beat = tmp_path / "heartbeat"
  r = _probe({"ZERO_JAX_HEARTBEAT_FILE": str(beat)})
  assert r["after"] == r["before"]
  assert not beat.exists()


def test_first_use_loads_only_the_subpackage_it_needs():
  code = ("import sys, zero_jax as zj\n"
          "zj.ZeroConfig(stage=2)\n"
          "print(sorted(m for m in sys.modules if m.startswith('zero_jax.')"
          " and m.count('.') == 1 and not m.startswith('zero_jax._')))\n")
  env = {**os.environ, "PYTHONPATH": _ROOT}
  out = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, timeout=120,
                       check=True)
  assert out.stdout.strip().splitlines()[-1] == "['zero_jax.config']"
