"""Multi-process runs: zero_jax.distributed and the zero_jax.launch launcher.

The launcher tests run plain Python children (fast); the rest start real
two-process JAX runs (4 CPU devices each, collectives over gloo) running
tests/distributed/_launch_script.py. One launched run (the ``launched`` fixture)
trains every stage and the tensor-parallel model, each checked against one
process by its own test, and ends feeding the processes different rows,
which both refuse (test_processes_that_feed_different_rows_both_fail_...).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import optax
import pytest

import zero_jax as zj
from tests import _models as m
from tests import _tp_models as tpm
from zero_jax.distributed import _runtime as distributed
from zero_jax.distributed import _failfast as failfast
from zero_jax.distributed import _launcher as launch
from zero_jax.distributed import _spawn as spawn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "distributed", "_launch_script.py")
# A failed process must bring the others down within this many seconds.
DEADLINE = 120
_CLUSTER_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                 "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_NODES",
                 "SLURM_NNODES", "OMPI_MCA_orte_hnp_uri",
                 "OMPI_COMM_WORLD_LOCAL_SIZE", "JOB_COMPLETION_INDEX")


@pytest.fixture
def plain_env(monkeypatch):
  """No launcher or cluster variables: a plain single-process run."""
  for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
              distributed.ENV_PROCESS_ID, distributed.ENV_CPU_DEVICES,
              *_CLUSTER_VARS):
    monkeypatch.delenv(var, raising=False)
  return monkeypatch


# ------------------------------------------------------------ settings


def test_settings_from_env():
  env = {"ZERO_JAX_COORDINATOR": "10.0.0.1:1234",
         "ZERO_JAX_NUM_PROCESSES": "4", "ZERO_JAX_PROCESS_ID": "3",
         "ZERO_JAX_CPU_DEVICES": "2"}
  s = distributed._settings_from_env(env)
  assert (s.coordinator_address, s.num_processes, s.process_id,
          s.cpu_devices) == ("10.0.0.1:1234", 4, 3, 2)
  s = distributed._settings_from_env({"ZERO_JAX_CPU_DEVICES": " "})
  assert s == distributed._Settings()


@pytest.mark.parametrize("env, match", [
    ({"ZERO_JAX_NUM_PROCESSES": "two"}, "ZERO_JAX_NUM_PROCESSES='two'"),
    ({"ZERO_JAX_NUM_PROCESSES": "0"}, ">= 1"),
    ({"ZERO_JAX_PROCESS_ID": "-1"}, "ZERO_JAX_PROCESS_ID"),
    ({"ZERO_JAX_CPU_DEVICES": "1.5"}, "ZERO_JAX_CPU_DEVICES"),
    ({"ZERO_JAX_NUM_PROCESSES": "2", "ZERO_JAX_PROCESS_ID": "2"},
     "not below"),
])
def test_settings_from_env_errors(env, match):
  with pytest.raises(ValueError, match=match):
    distributed._settings_from_env(env)


def test_cluster_detection(plain_env):
  assert distributed._detected_cluster() is None
  for var, value in (("SLURM_JOB_ID", "7"), ("SLURM_STEP_NODELIST", "n1"),
                     ("SLURM_NTASKS", "2"), ("SLURM_PROCID", "0"),
                     ("SLURM_LOCALID", "0")):
    plain_env.setenv(var, value)
  assert distributed._detected_cluster() == "slurm"


def test_one_process_per_node():
  slurm = {"SLURM_NTASKS": "4", "SLURM_STEP_NUM_NODES": "4"}
  assert distributed._one_process_per_node(slurm)
  assert not distributed._one_process_per_node(
      {**slurm, "SLURM_STEP_NUM_NODES": "2"})
  assert distributed._one_process_per_node({"OMPI_COMM_WORLD_LOCAL_SIZE": "1"})
  assert not distributed._one_process_per_node(
      {"OMPI_COMM_WORLD_LOCAL_SIZE": "8"})
  assert not distributed._one_process_per_node({})


def test_initialize_without_settings_does_nothing(plain_env):
  distributed.initialize()
  distributed.initialize()
  assert not jax.distributed.is_initialized()


def test_initialize_errors(plain_env):
  with pytest.raises(ValueError, match="missing: num_processes, process_id"):
    distributed.initialize("127.0.0.1:1234")
  plain_env.setenv("ZERO_JAX_NUM_PROCESSES", "2")
  with pytest.raises(ValueError, match="missing: coordinator_address"):
    distributed.initialize(process_id=0)
  # (conftest has started the backend already: too late for either.)
  plain_env.setenv("ZERO_JAX_COORDINATOR", "127.0.0.1:1234")
  plain_env.setenv("ZERO_JAX_PROCESS_ID", "0")
  with pytest.raises(RuntimeError, match="at the top of the script"):
    distributed.initialize()
  plain_env.setenv("ZERO_JAX_CPU_DEVICES", "4")
  with pytest.raises(RuntimeError, match="set up 4 CPU devices"):
    distributed.initialize()
  assert not jax.distributed.is_initialized()


def test_cpu_devices_alone_simulate_devices_in_one_process(plain_env):
  # ZERO_JAX_CPU_DEVICES without the rest: one process with that many CPU
  # devices, no distributed runtime.
  plain_env.setenv("ZERO_JAX_CPU_DEVICES", "3")
  plain_env.delenv("XLA_FLAGS", raising=False)
  code = ("from zero_jax import distributed\n"
          "distributed.initialize(); distributed.initialize()\n"
          "import jax\n"
          "print(len(jax.devices()), jax.distributed.is_initialized())\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["3", "False"]


class _FakeClient:
  def __init__(self):
    self.store = {}

  def key_value_set(self, key, value):
    self.store[key] = value

  def key_value_try_get(self, key):
    raise RuntimeError(f"NOT_FOUND: {key}")


def test_fail_fast_hook_publishes_the_error(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(a[0]))
  client = _FakeClient()
  guard = failfast._FailFast(client, process_id=1)
  guard.start()
  try:
    assert sys.excepthook == guard._excepthook
    sys.excepthook(ValueError, ValueError("bad batch"), None)
  finally:
    guard.stop()
  assert seen == [ValueError]  # the previous hook still prints it
  assert client.store == {
      "zero_jax/abort": "process 1 failed with ValueError: bad batch"}
  assert sys.excepthook != guard._excepthook  # restored
  assert not guard._thread.is_alive()


# ---------------------------------------------------------- batch rows


@pytest.mark.parametrize("replica", [1, 2])
def test_single_process_feeds_the_whole_batch(replica):
  mesh = zj.make_mesh(replica=replica)
  assert distributed.process_batch_slice(mesh, 32) == slice(0, 32)
  batch = m.mlp_batches(1)[0]
  local = distributed.local_batch(batch, mesh)
  assert jax.tree.structure(local) == jax.tree.structure(batch)
  for k in batch:
    assert isinstance(local[k], np.ndarray)
    np.testing.assert_array_equal(local[k], batch[k])
  assert distributed.is_main_process()


def test_batch_rows_errors():
  mesh = zj.make_mesh()
  with pytest.raises(ValueError, match="not divisible by the 8 devices"):
    distributed.process_batch_slice(mesh, 12)
  with pytest.raises(ValueError, match="disagree on the batch size"):
    distributed.local_batch({"x": np.zeros((8, 2)), "y": np.zeros((16,))},
                            mesh)
  with pytest.raises(ValueError, match="scalar"):
    distributed.local_batch({"x": np.zeros((8, 2)), "s": np.float32(1)}, mesh)


def test_row_ranges():
  rows = distributed._row_ranges
  assert rows([slice(4, 8), slice(0, 4), slice(8, 12)], 16) == [(0, 12)]
  assert rows([slice(None, None)] * 2, 16) == [(0, 16)]  # replicated
  assert rows([slice(8, 12), slice(0, 4)], 16) == [(0, 4), (8, 12)]
  with pytest.raises(ValueError, match="overlapping"):
    rows([slice(0, 8), slice(4, 12)], 16)


def test_rows_not_contiguous(monkeypatch):
  # A process whose devices hold rows 0-3 and 8-11 (a mesh not grouped by
  # process): local_batch gathers both ranges in order.
  monkeypatch.setattr(distributed, "_process_row_ranges",
                      lambda mesh, n: [(0, 4), (8, 12)])
  mesh = zj.make_mesh()
  with pytest.raises(ValueError, match="not one contiguous range"):
    distributed.process_batch_slice(mesh, 16)
  x = np.arange(16)
  np.testing.assert_array_equal(distributed.local_batch({"x": x}, mesh)["x"],
                                [0, 1, 2, 3, 8, 9, 10, 11])


# ------------------------------------------------------------ launcher


def _write(tmp_path, name, source):
  path = tmp_path / name
  path.write_text(textwrap.dedent(source))
  return str(path)


def test_launcher_environment_and_output(tmp_path, monkeypatch, capfd):
  script = _write(tmp_path, "show.py", """
      import os, sys
      keys = ("ZERO_JAX_COORDINATOR", "ZERO_JAX_NUM_PROCESSES",
              "ZERO_JAX_PROCESS_ID", "ZERO_JAX_CPU_DEVICES", "JAX_PLATFORMS",
              "XLA_FLAGS")
      print(" ".join(f"{k}={os.environ.get(k)}" for k in keys))
      print("args", sys.argv[1:], file=sys.stderr)
      """)
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                     "--xla_cpu_enable_fast_math=false")
  assert launch.main(["--nproc", "2", "--devices-per-proc", "3", "--port",
                      "4321", script, "a", "--b"]) == 0
  out, err = capfd.readouterr()
  for i in range(2):
    assert (f"[{i}] ZERO_JAX_COORDINATOR=127.0.0.1:4321 "
            f"ZERO_JAX_NUM_PROCESSES=2 ZERO_JAX_PROCESS_ID={i} "
            "ZERO_JAX_CPU_DEVICES=3 JAX_PLATFORMS=cpu "
            "XLA_FLAGS=--xla_cpu_enable_fast_math=false") in out
    assert f"[{i}] args ['a', '--b']" in err

  # -m: a module; without --devices-per-proc, nothing about CPU devices.
  _write(tmp_path, "show_mod.py", open(script).read())
  monkeypatch.setenv("PYTHONPATH", str(tmp_path))
  monkeypatch.setenv("ZERO_JAX_CPU_DEVICES", "5")
  assert launch.main(["--nproc", "1", "-m", "show_mod"]) == 0
  out, _ = capfd.readouterr()
  assert "[0] ZERO_JAX_COORDINATOR=127.0.0.1:" in out
  assert "ZERO_JAX_PROCESS_ID=0 ZERO_JAX_CPU_DEVICES=None" in out


def test_launcher_stops_the_others_when_one_fails(tmp_path, capfd):
  script = _write(tmp_path, "fail.py", """
      import os, signal, sys, time
      if os.environ["ZERO_JAX_PROCESS_ID"] == "1":
        time.sleep(0.5)
        sys.exit(3)
      def on_term(*_):
        print("got SIGTERM", flush=True)
        sys.exit(0)
      signal.signal(signal.SIGTERM, on_term)
      time.sleep(60)
      """)
  t0 = time.monotonic()
  assert launch.main(["--nproc", "2", script]) == 3
  assert time.monotonic() - t0 < 20
  out, err = capfd.readouterr()
  assert "[0] got SIGTERM" in out
  assert "process 1 exited with code 3" in err


def test_launcher_kills_after_grace_period(tmp_path, capfd):
  # Process 0 ignores SIGTERM; process 1 dies of SIGKILL (exit code 137).
  script = _write(tmp_path, "stubborn.py", """
      import os, signal, time
      if os.environ["ZERO_JAX_PROCESS_ID"] == "1":
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
      time.sleep(60)
      """)
  t0 = time.monotonic()
  assert launch.main(["--nproc", "2", "--grace-period", "1", script]) == 137
  assert time.monotonic() - t0 < 20
  assert "killing the remaining processes" in capfd.readouterr().err


def test_launcher_forwards_sigterm(tmp_path):
  script = _write(tmp_path, "wait.py", """
      import signal, sys, time
      def on_term(*_):
        print("got SIGTERM", flush=True)
        sys.exit(0)
      signal.signal(signal.SIGTERM, on_term)
      print("ready", flush=True)
      time.sleep(60)
      """)
  proc = subprocess.Popen(
      [sys.executable, "-m", "zero_jax.launch", "--nproc", "2", script],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    ready = 0
    while ready < 2:
      line = proc.stdout.readline()
      assert line, "launcher ended early: " + proc.stderr.read()
      ready += line.endswith("ready\n")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, err
  assert "[0] got SIGTERM" in out and "[1] got SIGTERM" in out


def test_launcher_argument_errors(capsys):
  with pytest.raises(SystemExit):
    launch.main(["--nproc", "0", "x.py"])
  assert "--nproc must be >= 1" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    launch.main(["x.py"])


# ------------------------------------------- two real JAX processes


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
  """The launched ``train`` run of _launch_script.py: its directory (the
  results and the checkpoints), exit status and output (stdout and stderr
  together, as the launcher prefixed them)."""
  out = tmp_path_factory.mktemp("train")
  proc = subprocess.run(
      [sys.executable, "-m", "zero_jax.launch", "--nproc", "2",
       "--devices-per-proc", "4", SCRIPT, "train", str(out)],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=300)
  return out, proc.returncode, proc.stdout


@pytest.fixture
def two_processes(launched):
  """The run's directory, once both processes have trained (the job then
  fails by design: test_processes_that_feed_different_rows_both_fail_...)."""
  out, _, log = launched
  assert "[0] process 0 done" in log, log[-5000:]
  assert "[1] process 1 done" in log, log[-5000:]
  return out


def test_two_processes_match_one_at_every_stage(two_processes):
  """2 processes x 4 devices, launched, equal 1 process x 8 devices: every
  stage, and stage 3 with the processes as replica groups."""
  result = np.load(two_processes / "result.npz")

  ref_losses, ref_params = m.train_reference(
      m.mlp_loss, optax.adamw(1e-2), m.mlp_params(), m.mlp_batches(5))
  runs = {"s0": (0, 1), "s1": (1, 1), "s2": (2, 1), "s3": (3, 1),
          "r2s3": (3, 2)}  # as in _launch_script.RUNS
  for run, (stage, replica) in runs.items():
    engine = zj.Engine(m.mlp_loss, optax.adamw(1e-2),
                       zj.ZeroConfig(stage=stage, min_shard_elements=0),
                       zj.make_mesh(replica=replica))
    losses, params, _ = m.train_engine(engine, m.mlp_params(),
                                       m.mlp_batches(5))
    got_losses = list(result[f"{run}/losses"])
    got_params = {k: result[f"{run}/{k}"] for k in ref_params}
    m.assert_matches(got_losses, got_params, losses, params, tol=1e-6)
    m.assert_matches(got_losses, got_params, ref_losses, ref_params)

  # The checkpoints both processes wrote restore in this one process (at
  # stage 1 on 8 devices) and train on as if never interrupted.
  ten = m.mlp_batches(10)  # the first 5 are the batches trained above
  ref_losses, ref_params = m.train_reference(
      m.mlp_loss, optax.adamw(1e-2), m.mlp_params(), ten)
  for run in ("s3", "r2s3"):
    engine = zj.Engine(m.mlp_loss, optax.adamw(1e-2),
                       zj.ZeroConfig(stage=1, min_shard_elements=0),
                       zj.make_mesh())
    with zj.Checkpointer(two_processes / f"ckpt_{run}") as ckpt:
      state = ckpt.restore(engine, m.mlp_params())
    assert int(state.step) == 5
    state, losses = m.run_steps(engine, state, ten[5:])
    m.assert_matches(list(result[f"{run}/losses"]) + losses,
                     engine.gather_params(state), ref_losses, ref_params)


def test_two_processes_on_data_x_model_match_one(two_processes):
  """ZeRO with tensor parallelism across processes: stage 3 on (data 4,
  model 2), 2 data x 2 model ranks per process, equals one process and
  single-device optax. (Was tests/distributed/test_tp_multiprocess.py,
  with its own launch.)"""
  result = np.load(two_processes / "result.npz")
  steps = 3  # _launch_script.TP_STEPS (the script starts JAX's
  # distributed runtime as it is imported, so it is not imported here)
  tx = optax.adamw(1e-2, weight_decay=0.1)  # _launch_script.TP_TX
  # Each process fed its half of every global batch of 16.
  np.testing.assert_array_equal(result["tp/rows"], [8] * steps)

  batches = tpm.tp_batches(steps)
  ref_losses, ref_params = m.train_reference(tpm.nnx_loss, tx,
                                             tpm.nnx_init(), batches)
  # The same engine in this one process, on its 8 devices.
  engine = zj.Engine(tpm.nnx_loss, tx,
                     zj.ZeroConfig(stage=3, min_shard_elements=0),
                     zj.make_mesh(model=2))
  losses, params, _ = m.train_engine(engine, tpm.nnx_init(), batches)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  assert list(result["tp/paths"]) == [jax.tree_util.keystr(p)
                                      for p, _ in flat]
  got = jax.tree.unflatten(jax.tree.structure(params),
                           [result[f"tp/param/{i}"]
                            for i in range(len(flat))])
  got_losses = list(result["tp/losses"])
  m.assert_matches(got_losses, got, losses, params, tol=1e-6)
  m.assert_matches(got_losses, got, ref_losses, ref_params)


def test_two_processes_train_a_global_loss_over_micro_batches_as_one(
    two_processes):
  """A masked mean of global meaning (``loss_scope="global"``) over two
  micro-batches weighed by their counts, at stage 3 across both processes:
  the first step's split check and every step agree with one process and
  with single-device optax on the global batches."""
  result = np.load(two_processes / "result.npz")
  tx = optax.adamw(1e-2)
  batches = m.mlp_batches(5)  # _launch_script.STEPS
  ref_losses, ref_params = m.train_reference(m.mlp_masked_loss, tx,
                                             m.mlp_params(), batches)
  engine = zj.Engine(m.mlp_masked_loss, tx,
                     zj.ZeroConfig(stage=3, min_shard_elements=0,
                                   loss_scope="global", grad_accum_steps=2),
                     zj.make_mesh(), loss_weight=m.mlp_masked_count)
  losses, params, _ = m.train_engine(engine, m.mlp_params(), batches)
  got_losses = list(result["global/losses"])
  got_params = {k: result[f"global/{k}"] for k in ref_params}
  m.assert_matches(got_losses, got_params, losses, params, tol=1e-6)
  m.assert_matches(got_losses, got_params, ref_losses, ref_params)


def test_processes_that_feed_different_rows_both_fail_naming_them(launched):
  """Two steps on agreeing batches, then process 1 feeds 4 rows and process
  0 8. Without the check, one process's rows would weigh double and the job
  exit 0; with it, both processes fail, each naming what both fed. (The
  end of the launched run above; was test_agreement.py's, with its own
  launch.)"""
  _, rc, out = launched
  assert rc != 0, out[-5000:]
  lines = out.splitlines()
  fed = ("ValueError: the processes fed different batches to this step: "
         "process 0 fed 8 rows, process 1 fed 4 rows.")
  for i in range(2):
    assert any(l.startswith(f"[{i}] process {i} took 2 steps")
               for l in lines), out[-5000:]
    # Its own error, or (a process slower to reach the check than the
    # other's failure is to reach it: fail-fast polls each second) the
    # other's, with which it stops.
    assert any(l.startswith(f"[{i}] {fed}") or (
        l.startswith(f"[{i}] zero_jax.distributed: process {1 - i} failed "
                     f"with {fed}") and l.endswith(f"stopping process {i} "
                                                   "too.")) for l in lines), \
        out[-5000:]
  assert "trained on disagreeing batches" not in out
  # (Shown with pytest -s: what the check adds to every step.)
  print("\n" + "\n".join(l for l in lines if "the batch check costs" in l))


def _start_pair(mode, out_dir):
  """Two processes of _launch_script.py, started directly (no launcher, so
  that nothing but JAX and zero_jax stops them)."""
  port = spawn.free_port()
  procs = []
  for i in range(2):
    log = open(out_dir / f"log{i}.txt", "w")
    procs.append(subprocess.Popen(
        [sys.executable, SCRIPT, mode, str(out_dir)], cwd=ROOT,
        env=spawn.child_env(os.environ, i, 2, port, 4),
        stdout=log, stderr=subprocess.STDOUT))
    log.close()
  return procs


def _wait(proc, timeout):
  try:
    return proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    return None


def _logs(out_dir):
  return "\n".join((out_dir / f"log{i}.txt").read_text()[-3000:]
                   for i in range(2))


@pytest.mark.parametrize("victim", [0])
def test_killed_process_stops_the_other(victim, tmp_path):
  """SIGKILL one process mid-training: the survivor exits non-zero. (Process
  0, the coordinator; a killed process 1 is test_launch_faults.py's, through
  the launcher.)"""
  procs = _start_pair("loop", tmp_path)
  try:
    deadline = time.monotonic() + 240
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
      assert all(p.poll() is None for p in procs), _logs(tmp_path)
      assert time.monotonic() < deadline, _logs(tmp_path)
      time.sleep(0.1)
    t0 = time.monotonic()
    procs[victim].kill()
    rc = _wait(procs[1 - victim], DEADLINE)
    elapsed = time.monotonic() - t0
    # (Shown with pytest -s: the figures the README quotes.)
    print(f"\nprocess {victim} SIGKILLed: process {1 - victim} exited "
          f"{rc} after {elapsed:.1f} s")
    assert rc is not None, f"survivor still running after {DEADLINE} s"
    assert rc != 0, _logs(tmp_path)
    assert elapsed < DEADLINE
  finally:
    for p in procs:
      p.kill()
      p.wait()


def test_exception_in_one_process_stops_the_other(tmp_path):
  """Process 1 raises while process 0 is in host code: fail_fast tells
  process 0, which exits at once (JAX alone: after the heartbeat timeout)."""
  procs = _start_pair("raise", tmp_path)
  try:
    t0 = time.monotonic()
    rc1 = _wait(procs[1], DEADLINE)
    rc0 = _wait(procs[0], DEADLINE)
    elapsed = time.monotonic() - t0
  finally:
    for p in procs:
      p.kill()
      p.wait()
  logs = _logs(tmp_path)
  assert rc1 == 1 and rc0 == 1, logs
  assert "ValueError: deliberate failure" in logs
  assert "process 1 failed with ValueError: deliberate failure; stopping " \
         "process 0 too" in logs
  # Start-up included; JAX alone would take the heartbeat timeout (30 s).
  print(f"\nprocess 1 raised: both exited after {elapsed:.1f} s, start-up "
        "included")
  assert elapsed < 25, elapsed


def test_sigterm_to_the_launcher_saves_one_checkpoint_for_both(tmp_path):
  """Preemption: the launcher forwards SIGTERM; JAX's preemption service
  picks one step for both processes, which save it and exit 143; one
  process restores it."""
  proc = subprocess.Popen(
      [sys.executable, "-m", "zero_jax.launch", "--nproc", "2",
       "--devices-per-proc", "4", SCRIPT, "loop", str(tmp_path)], cwd=ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 240
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
      assert proc.poll() is None, proc.stdout.read()[-5000:]
      assert time.monotonic() < deadline
      time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=DEADLINE)[0]
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, out[-5000:]
  steps = {line.split()[-1] for line in out.splitlines()
           if "preempted at step" in line}
  assert len(steps) == 1 and out.count("preempted at step") == 2, out[-5000:]
  step = int(steps.pop())
  engine = zj.Engine(m.mlp_loss, optax.adamw(1e-2),
                     zj.ZeroConfig(stage=2, min_shard_elements=0),
                     zj.make_mesh(4))
  with zj.Checkpointer(tmp_path / "ckpt") as ckpt:
    assert ckpt.all_steps() == [step]
    assert int(ckpt.restore(engine, m.mlp_params()).step) == step
