"""Several runs of experiments/train_gpt.py in one process (see
test_demo.py): JAX starts once for all of them.

Usage, from anywhere::

  python tests/experiments/_demo_runs.py SPEC.json OUT_DIR

``SPEC.json`` maps a run's name to ``{"argv": [...], "block": [...]}``.
Each run, in order, calls the demo's ``main()`` as ``python
experiments/train_gpt.py ARGV`` would, with the modules named in ``block``
made unimportable (as on an install without them), and writes
``OUT_DIR/<name>.out`` and ``.err`` (what it printed to stdout and stderr)
and ``OUT_DIR/<name>.rc``: its exit status, that of the ``SystemExit`` it
raised (argparse's errors: 2), 0 if it returned, 1 (the traceback in
``.err``) for any other exception.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import time
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
DEMO = os.path.join(_ROOT, "experiments", "train_gpt.py")


def _status(e: SystemExit) -> int:
  """The exit status Python gives a ``SystemExit``."""
  if e.code is None:
    return 0
  if isinstance(e.code, int):
    return e.code
  print(e.code, file=sys.stderr)
  return 1


def run(name: str, argv: list[str], block: list[str], out_dir: str,
        demo_main) -> None:
  """One run of the demo's ``demo_main``; writes its output and status."""
  blocked = {m: sys.modules.get(m) for m in block}
  path = os.path.join(out_dir, name)
  with open(path + ".out", "w") as out, open(path + ".err", "w") as err:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      sys.argv = [DEMO, *argv]
      for m in block:
        sys.modules[m] = None  # (an ImportError on import)
      try:
        demo_main()
        status = 0
      except SystemExit as e:
        status = _status(e)
      except Exception:  # pylint: disable=broad-except
        traceback.print_exc()
        status = 1
      finally:
        for m, module in blocked.items():
          if module is None:
            sys.modules.pop(m, None)
          else:
            sys.modules[m] = module
  with open(path + ".rc", "w") as f:
    f.write(str(status))


def main(spec_path: str, out_dir: str) -> None:
  sys.path.insert(0, _ROOT)
  # The demo's module, not run as __main__: its main() is called per run.
  demo = runpy.run_path(DEMO, run_name="train_gpt")
  with open(spec_path) as f:
    spec = json.load(f)
  for name, r in spec.items():
    t0, c0 = time.perf_counter(), time.process_time()
    run(name, r["argv"], r.get("block", []), out_dir, demo["main"])
    print(f"{name}: {time.perf_counter() - t0:.1f} s, CPU "
          f"{time.process_time() - c0:.1f} s", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
