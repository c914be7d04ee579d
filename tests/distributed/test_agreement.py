"""What the processes of a run must agree on (zero_jax.train's
_agreement): the batch every step feeds, and that they run as one job at
all.

The exchange itself is tested against an in-memory coordinator, two
threads standing for two processes; the end-to-end tests launch two real
JAX processes (4 CPU devices each) under a time limit. (Processes that feed
different rows: test_distributed.py's launched run ends with them, in
test_processes_that_feed_different_rows_both_fail_naming_them.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import optax
import pytest

import zero_jax as zj
from tests import _models as m
from zero_jax import train
from zero_jax.distributed import _failfast as failfast
from zero_jax.train import _agreement as agreement

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


class _Coordinator:
  """The coordination service's key-value store, in memory, with its
  blocking get (as the jaxlib client raises a timeout)."""

  def __init__(self):
    self.store: dict[str, str] = {}
    self.changed = threading.Condition()

  def key_value_set(self, key, value, allow_overwrite=False):
    with self.changed:
      if key in self.store and not allow_overwrite:
        raise RuntimeError(f"ALREADY_EXISTS: {key}")
      self.store[key] = value
      self.changed.notify_all()

  def key_value_dir_get(self, prefix):
    with self.changed:
      return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]

  def key_value_try_get(self, key):
    with self.changed:
      if key not in self.store:
        raise RuntimeError(f"NOT_FOUND: {key}")
      return self.store[key]

  def blocking_key_value_get(self, key, timeout_in_ms):
    with self.changed:
      if not self.changed.wait_for(lambda: key in self.store,
                                   timeout_in_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out "
                           f"with key: {key}")
      return self.store[key]

  def key_value_delete(self, key):
    with self.changed:
      for k in [k for k in self.store if k == key or
                k.startswith(key + "/")]:
        del self.store[k]


def _rounds(client, pid, rounds, values):
  """Process ``pid``'s side of ``rounds`` rounds; appends what it got."""
  for count in range(1, rounds + 1):
    values.append(agreement.exchange_round(
        client, pid, 2, "t", count, f"{pid}:{count}", timeout=10))


def test_every_process_gets_every_value_and_old_rounds_are_deleted():
  client = _Coordinator()
  got = ([], [])
  threads = [threading.Thread(target=_rounds, args=(client, i, 130, got[i]))
             for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  for i in range(2):
    assert got[i] == [[f"0:{c}", f"1:{c}"] for c in range(1, 131)]
  # Groups of 64 rounds: the first two were deleted once every process had
  # left them, so the store holds the current group only (rounds 128-130:
  # two values and the published round each).
  assert len(client.store) == 9, sorted(client.store)
  assert all(k.startswith("zero_jax/agree/t/2/") for k in client.store)


def test_a_process_that_never_comes_is_named():
  client = _Coordinator()
  t0 = time.monotonic()
  with pytest.raises(TimeoutError, match=r"process\(es\) \[1\] did not reach "
                     r"round 1 of the processes' t check within 0.3 s of "
                     r"process\(es\) \[0\]: every process must call "
                     "engine.step"):
    agreement.exchange_round(client, 0, 2, "t", 1, "x", timeout=0.3)
  assert time.monotonic() - t0 < 5


def test_a_waiting_process_stops_when_another_failed():
  """Fail-fast's error (with its exit-code mark) ends the wait at the next
  poll, through the abort probe that armed fail-fast registers."""
  client = _Coordinator()
  client.key_value_set(failfast.ABORT_KEY,
                       "process 1 failed with ValueError: boom"
                       + failfast.ABORT_CODE_MARK + "3")
  restore = train.set_abort_probe(failfast.published_failure)
  try:
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"another process failed while "
                       r"this one waited for the others' t \(round 1\): "
                       r"process 1 failed with ValueError: boom$"):
      agreement.exchange_round(client, 0, 2, "t", 1, "x", timeout=60)
    assert time.monotonic() - t0 < 5
  finally:
    restore()
  # Without it (fail-fast not armed: no process publishes a failure), the
  # wait goes on until its timeout.
  with pytest.raises(TimeoutError):
    agreement.exchange_round(client, 0, 2, "t", 2, "x", timeout=0.3)


def _others_fed(monkeypatch, other_batch):
  """check_batch as process 0 of 2, process 1 having fed ``other_batch``."""
  monkeypatch.setattr(agreement, "_runtime", lambda: (None, 0, 2))

  def exchange(tag, value):
    assert tag == "batch"
    rows, leaves = agreement._signature(other_batch)
    return [value, json.dumps([rows, leaves])]

  monkeypatch.setattr(agreement, "exchange", exchange)


def _batch(rows, width=16):
  return {"x": np.zeros((rows, width), np.float32),
          "y": np.zeros((rows, 8), np.float32)}


def test_check_batch_names_the_rows_each_process_fed(monkeypatch):
  _others_fed(monkeypatch, _batch(4))
  with pytest.raises(ValueError, match=r"the processes fed different "
                     r"batches to this step: process 0 fed 8 rows, process "
                     r"1 fed 4 rows\. Every process must feed its slice"):
    agreement.check_batch(_batch(8), 2)
  # Same rows, another width: the leaves are named.
  _others_fed(monkeypatch, _batch(8, width=12))
  with pytest.raises(ValueError, match=r"process 0 fed 8 rows, process 1 "
                     r"fed 8 rows; leaves process 0: \['x'\] \(8, 16\) "
                     r"float32, \['y'\] \(8, 8\) float32; process 1: "
                     r"\['x'\] \(8, 12\) float32"):
    agreement.check_batch(_batch(8), 2)
  _others_fed(monkeypatch, _batch(8))
  agreement.check_batch(_batch(8), 2)  # agreeing: nothing


def test_a_launched_process_left_alone_is_refused_at_its_first_step(
    monkeypatch):
  """The launcher's variables say 2 processes, JAX runs one (initialize()
  never called): the first step refuses, naming the call to make."""
  engine = zj.Engine(m.mlp_loss, optax.adamw(1e-2),
                     zj.ZeroConfig(stage=1, min_shard_elements=0),
                     zj.make_mesh())
  state = engine.init(m.mlp_params())
  batch = m.mlp_batches(1)[0]
  monkeypatch.setenv(agreement.ENV_NUM_PROCESSES, "2")
  monkeypatch.setenv(agreement.ENV_PROCESS_ID, "1")
  with pytest.raises(RuntimeError, match=r"ZERO_JAX_NUM_PROCESSES=2 makes "
                     r"this process 1 of 2 \(python -m zero_jax.launch sets "
                     r"it\), but JAX runs it alone .* the script never "
                     r"called zero_jax.distributed.initialize\(\)"):
    engine.step(state, batch)
  assert "zero_jax.distributed.initialize()" in agreement.alone_at_exit()
  monkeypatch.setenv(agreement.ENV_NUM_PROCESSES, "1")
  assert agreement.alone_at_exit() is None
  state, metrics = engine.step(state, batch)  # (--nproc 1: one is right)
  assert np.isfinite(float(metrics["loss"]))


# ------------------------------------------------- two real JAX processes


def _launch(*args: str, timeout: float) -> tuple[int, str]:
  proc = subprocess.run(
      [sys.executable, "-m", "zero_jax.launch", "--nproc", "2",
       "--devices-per-proc", "4", *args], cwd=ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, timeout=timeout)
  return proc.returncode, proc.stdout


def test_a_script_that_never_initializes_fails(tmp_path):
  """Under the launcher, a script that never calls initialize() would run
  as two single processes: with the engine it fails at its first step;
  with plain JAX, when it ends. Both name distributed.initialize()."""
  engine_script = tmp_path / "alone_engine.py"
  engine_script.write_text(textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {ROOT!r})
      import optax
      import zero_jax as zj
      from tests import _models as m
      engine = zj.Engine(m.mlp_loss, optax.adamw(1e-2),
                         zj.ZeroConfig(stage=3), zj.make_mesh())
      state = engine.init(m.mlp_params())
      state, _ = engine.step(state, m.mlp_batches(1)[0])
      print("trained alone", flush=True)
      """))
  jax_script = tmp_path / "alone_jax.py"
  jax_script.write_text(textwrap.dedent("""
      import jax.numpy as jnp
      print("sum", float(jnp.ones(3).sum()), flush=True)
      """))
  rc, out = _launch(str(engine_script), timeout=120)
  assert rc != 0, out[-5000:]
  assert "trained alone" not in out
  assert "never called zero_jax.distributed.initialize()" in out, out[-5000:]
  rc, out = _launch(str(jax_script), timeout=120)
  assert rc == 1, out[-5000:]
  # It ran, alone, to its end. The first process to end fails the job,
  # and the launcher may stop the other before it prints anything.
  assert re.search(r"\[[01]\] sum 3\.0", out), out[-5000:]
  assert re.search(r"\[[01]\] zero_jax\.launch: ZERO_JAX_NUM_PROCESSES=2 "
                   r"makes this process [01] of 2 \(python -m "
                   r"zero_jax\.launch sets it\), but JAX runs it alone .* "
                   r"never called zero_jax\.distributed\.initialize\(\)",
                   out), out[-5000:]
