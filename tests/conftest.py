"""8 simulated CPU devices for every test; set before jax is imported.

The models are tiny, so compiling dominates the suite. Three things shorten
it (docs/design.md, "Tests"; the README gives its time):

- XLA's LLVM backend optimizations are turned down, and programs compiled
  for GPUs without one skip autotuning (which cannot time anything there
  and, on jax 0.12, took a third of each such compile). Both act after
  buffer assignment and scheduling: the compiled steps' argument, output,
  temp, alias and host bytes, their collectives and, for GPUs, their HLO
  less kernel launch configurations are identical with and without them
  (``PYTHONPATH=. python experiments/compile_flags.py``).
- One persistent compilation cache serves the whole run: its workers and
  every process a test starts (they inherit the environment), so a program
  compiled once is read back, not compiled again. It is a new directory
  per run, so a run takes what it takes on a new machine, removed at the
  end; ``ZERO_JAX_TEST_CACHE=DIR`` uses DIR and keeps it (CI shares one
  between its legs of the same jax version; JAX keys each program by its
  jax version, flags and devices, so sharing never mixes programs).
  Programs compiled for GPUs without one are compiled every time: JAX
  writes them to the cache but cannot read them back (pyproject.toml
  silences its warning).
- Under pytest-xdist each test file runs whole on one worker
  (``pytest_xdist_make_scheduler``), so what a file compiles once (its
  cached steps and module fixtures) is compiled once in the run, not once
  per worker; files start longest first, by the last run's times.
"""

import os
import shutil
import tempfile

_FLAGS = {"xla_force_host_platform_device_count": "8",
          "xla_backend_optimization_level": "0",
          "xla_llvm_disable_expensive_passes": "true",
          "xla_gpu_autotune_level": "0"}
for _name, _value in _FLAGS.items():
  if _name not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --{_name}={_value}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The run's compilation cache. The first process to get here (pytest's
# main process) makes it; its workers and subprocesses find it set.
_OWNED = "ZERO_JAX_TEST_CACHE_OWNER"
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _kept = os.environ.get("ZERO_JAX_TEST_CACHE")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _kept or tempfile.mkdtemp(
      prefix="zero_jax_tests_xla_")
  if not _kept:
    os.environ[_OWNED] = str(os.getpid())
# Every program, however quick to compile: most of the suite's are.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402  (must come after the flags)
import pytest  # noqa: E402

assert len(jax.devices()) >= 8, (
    "tests need 8 devices; XLA_FLAGS was set too late: " +
    os.environ["XLA_FLAGS"])

_DURATIONS = "zero_jax/file_seconds"


def pytest_unconfigure(config):
  del config
  if os.environ.get(_OWNED) == str(os.getpid()):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"],
                  ignore_errors=True)


def _file_of(nodeid: str) -> str:
  return nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist's)
def pytest_xdist_make_scheduler(config, log):
  """Whole files to a worker, the longest (by the last run) first."""
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=g-import-not-at-top

  seconds = (config.cache.get(_DURATIONS, {})
             if getattr(config, "cache", None) else {})
  # Files in collection order (not xdist's order by number of tests), then
  # longest first where the last run timed them.
  config.option.loadscopereorder = False

  class LongestFileFirst(LoadFileScheduling):

    def _assign_work_unit(self, node):
      if not getattr(self, "_ordered", False):
        self._ordered = True
        for scope in sorted(self.workqueue,
                            key=lambda f: -seconds.get(_file_of(f), 0.0)):
          self.workqueue.move_to_end(scope)
      super()._assign_work_unit(node)

  return LongestFileFirst(config, log)


_seconds_this_run: dict[str, float] = {}


def pytest_runtest_logreport(report):
  # (Runs in the main process too, for every worker's report.)
  name = _file_of(report.nodeid)
  _seconds_this_run[name] = _seconds_this_run.get(name, 0.0) + (
      report.duration or 0.0)


def pytest_sessionfinish(session):
  if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(
      session.config, "cache", None) or not _seconds_this_run:
    return
  merged = dict(session.config.cache.get(_DURATIONS, {}))
  merged.update(_seconds_this_run)
  session.config.cache.set(_DURATIONS, merged)
