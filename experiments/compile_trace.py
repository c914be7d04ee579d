"""Where the test suite's time goes: every XLA compile, by platform.

Runs pytest with a hook in every process it starts (its xdist workers and
their subprocesses, through a ``sitecustomize`` on ``PYTHONPATH``) that
times each backend compile (``jax._src.compiler.compile_or_get_cached``)
with its platform, program hash and test. Then it prints the summed test
time (from pytest's junit XML), the compile time per platform, and the
time spent compiling a program a second time::

  python experiments/compile_trace.py -- -q -n 2 tests -p no:cacheprovider
  python experiments/compile_trace.py -- -q tests/analysis/test_overlap.py

(The hook wraps a private jax function; it is a diagnostic, not part of
zero_jax.)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

# The hook, installed in each Python the run starts: it wraps the compile
# entry point once jax's interpreter module has loaded.
_SITECUSTOMIZE = r'''
import os, sys
if os.environ.get("ZJ_TRACE_COMPILES"):
  import hashlib, importlib.util, json, threading, time
  _lock = threading.Lock()

  def _install():
    import jax._src.compiler as c
    import jax._src.interpreters.pxla as px
    orig = c.compile_or_get_cached
    def wrapped(backend, computation, *a, **k):
      t = time.perf_counter()
      out = orig(backend, computation, *a, **k)
      dt = time.perf_counter() - t
      try:
        name = computation.operation.attributes["sym_name"].value
      except Exception:
        name = "?"
      plat = getattr(backend, "platform", "?")
      # Hashing small CPU programs would cost more than compiling them.
      h = (hashlib.sha1(str(computation).encode()).hexdigest()[:16]
           if plat != "cpu" or dt > 0.3 else "")
      rec = dict(p=plat, n=name, t=round(dt, 4), h=h,
                 test=os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0])
      with _lock, open(os.environ["ZJ_TRACE_COMPILES"], "a") as f:
        f.write(json.dumps(rec) + "\n")
      return out
    c.compile_or_get_cached = wrapped
    if getattr(px, "compile_or_get_cached", None) is orig:
      px.compile_or_get_cached = wrapped

  class _Finder:
    def find_spec(self, name, path, target=None):
      if name != "jax._src.interpreters.pxla":
        return None
      sys.meta_path.remove(self)
      spec = importlib.util.find_spec(name)
      run = spec.loader.exec_module
      def exec_module(mod):
        run(mod)
        _install()
      spec.loader.exec_module = exec_module
      return spec

  sys.meta_path.insert(0, _Finder())
'''


def summarize(trace: str, junit: str) -> dict:
  """The run's totals, in seconds summed over every process."""
  rows = [json.loads(line) for line in open(trace)] if os.path.exists(
      trace) else []
  by_platform = collections.defaultdict(lambda: [0, 0.0])
  seen, again = set(), 0.0
  for r in rows:
    by_platform[r["p"]][0] += 1
    by_platform[r["p"]][1] += r["t"]
    if r["h"]:
      key = (r["p"], r["h"])
      if key in seen:
        again += r["t"]
      seen.add(key)
  cases = list(ET.parse(junit).getroot().iter("testcase"))
  return {
      "tests": len(cases),
      "summed_test_s": round(sum(float(c.get("time", 0)) for c in cases), 1),
      "compiles": len(rows),
      "compile_s": round(sum(r["t"] for r in rows), 1),
      "by_platform": {p: {"compiles": n, "s": round(t, 1)}
                      for p, (n, t) in sorted(by_platform.items())},
      "compiled_again_s": round(again, 1),
  }


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("pytest_args", nargs="*",
                 help="pytest's arguments, after --")
  args = p.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
      f.write(_SITECUSTOMIZE)
    trace, junit = os.path.join(tmp, "trace.jsonl"), os.path.join(
        tmp, "junit.xml")
    env = dict(os.environ, ZJ_TRACE_COMPILES=trace,
               PYTHONPATH=os.pathsep.join(
                   [tmp] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
    rc = subprocess.call([sys.executable, "-m", "pytest", *args.pytest_args,
                          f"--junitxml={junit}"], env=env)
    print(json.dumps(summarize(trace, junit), indent=1))
  return rc


if __name__ == "__main__":
  sys.exit(main())
