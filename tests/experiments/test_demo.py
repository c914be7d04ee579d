"""The demo trains from a DeepSpeed config, as a migrating user brings it.

The demo (experiments/train_gpt.py) runs as a user runs it, at its smallest
model. Its single-process runs, refusals included, run one after another
in one process (tests/experiments/_demo_runs.py: JAX starts once), each
with its own output and exit status, which the tests below check; the
resumed run (a new process, as after a kill) and the launched one run on
their own.
"""

import json
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

import zero_jax as zj
from tests._gpu import compiles_for_gpus

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# A migrating user's config, as shipped in experiments/: stage 2, fp16 with
# dynamic loss scaling, optimizer offload to CPU (with an NVMe path that CPU
# offload ignores), and DeepSpeed's batch arithmetic: 32 = 8 per device x 4
# micro-batches x 1 device.
with open(os.path.join(_ROOT, "experiments", "ds_config.json")) as _f:
  DEEPSPEED = json.load(_f)


_DEMO = os.path.join(_ROOT, "experiments", "train_gpt.py")
_RUNS = os.path.join(_ROOT, "tests", "experiments", "_demo_runs.py")
# The demo's smallest model.
_TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len",
         "16"]


def _demo_args(tmp_path, name, config, devices, steps=4, *extra,
               table=False):
  """The demo's arguments for a run named ``name``, its metrics log in
  ``tmp_path/<name>.jsonl``."""
  args = ["--devices", str(devices), *extra]
  if not table:
    args.append("--skip-memory-table")
  if config is not None:
    path = tmp_path / f"{name}_ds_config.json"
    path.write_text(json.dumps(config))
    args += ["--deepspeed-config", str(path)]
  return [*args, "--steps", str(steps), *_TINY, "--log-jsonl",
          str(tmp_path / f"{name}.jsonl")]


class _Run:
  """What a run left: like ``subprocess.run``'s result, and its log."""

  def __init__(self, returncode, stdout, stderr, log):
    self.returncode, self.stdout, self.stderr = returncode, stdout, stderr
    self.log = log


def _rows(log):
  return [json.loads(line) for line in log.read_text().splitlines()]


# The contradictory flags of test_demo_refuses_contradictory_flags, and the
# two flags each refusal must name.
CONTRADICTIONS = [
    (["--plot", "m.png", "--skip-memory-table"],
     ("--plot", "--skip-memory-table")),
    (["--deepspeed-config", "c.json", "--stage", "1"],
     ("--stage", "--deepspeed-config")),
    (["--deepspeed-config", "c.json", "--compute-dtype", "float32"],
     ("--compute-dtype", "--deepspeed-config")),
    (["--deepspeed-config", "c.json", "--batch-size", "8"],
     ("--batch-size", "--deepspeed-config")),
    (["--deepspeed-config", "c.json", "--grad-accum-steps", "1"],
     ("--grad-accum-steps", "--deepspeed-config")),
    (["--deepspeed-config", "c.json", "--clip-grad-norm", "1"],
     ("--clip-grad-norm", "--deepspeed-config")),
    (["--deepspeed-config", "c.json", "--offload-optimizer", "host"],
     ("--offload-optimizer", "--deepspeed-config")),
    (["--save-every", "5"], ("--save-every", "--checkpoint-dir")),
    (["--keep", "2"], ("--keep", "--checkpoint-dir")),
    (["--export-dtype", "bfloat16"], ("--export-dtype", "--export-params")),
]


def _spec(tmp):
  """The single-process runs of the tests below, their files in ``tmp``:
  {name: {"argv": the demo's arguments, "block": modules made
  unimportable}}."""
  spec = {
      # test_demo_trains_with_the_deepspeed_config
      **{f"deepspeed_{micro}_{devices}": _demo_args(
          tmp, f"deepspeed_{micro}_{devices}",
          dict(DEEPSPEED, train_micro_batch_size_per_gpu=micro), devices)
         for micro, devices in ((8, 1), (1, 8))},
      # test_demo_resumes_at_another_stage_and_device_count's first run;
      # also the one process of test_the_launcher_runs_the_demo_...
      "eight": _demo_args(tmp, "eight", None, 8, 6, "--checkpoint-dir",
                          str(tmp / "ckpt"), "--save-every", "2",
                          "--keep", "2"),
      # test_the_gpu_preset_runs_on_cpu_at_a_shrunk_size
      "gpu": _demo_args(tmp, "gpu", None, 8, 2, "--preset", "gpu",
                        "--batch-size", "16", "--loss-chunk", "16"),
      # test_on_one_device_the_table_is_also_compiled_for_8_h100s and
      # test_demo_prints_the_step_1_loss_and_each_table_compile
      "table": _demo_args(tmp, "table", None, 1, 2, "--batch-size", "16",
                          table=True),
      # test_demo_trains_in_low_precision_on_one_device
      **{dtype: _demo_args(tmp, dtype, None, 1, 2, "--compute-dtype", dtype)
         for dtype in ("bfloat16", "float16")},
      # test_demo_checks_plots_dependency_before_training
      "no_matplotlib": _demo_args(tmp, "no_matplotlib", None, 8, 2,
                                  "--plot", str(tmp / "m.png"), table=True),
      # test_demo_refuses_contradictory_flags
      **{f"flags{i}": flags for i, (flags, _) in enumerate(CONTRADICTIONS)},
  }
  return {name: {"argv": argv, "block": ["matplotlib"] * (
      name == "no_matplotlib")} for name, argv in spec.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Every single-process run of the tests below, one after another in one
  process: {name: _Run}."""
  tmp = tmp_path_factory.mktemp("demo")
  spec = _spec(tmp)
  (tmp / "spec.json").write_text(json.dumps(spec))
  # (A hang guard only: the ~20 runs once had 300 s each; on a loaded
  # 2-core machine all of them took 650 s.)
  out = subprocess.run(
      [sys.executable, _RUNS, str(tmp / "spec.json"), str(tmp)], cwd=tmp,
      env=dict(os.environ, PYTHONPATH=_ROOT), capture_output=True, text=True,
      timeout=1800)
  assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
  return {name: _Run(int((tmp / f"{name}.rc").read_text()),
                     (tmp / f"{name}.out").read_text(),
                     (tmp / f"{name}.err").read_text(),
                     tmp / f"{name}.jsonl") for name in spec}


@pytest.mark.parametrize("micro,devices", [(8, 1), (1, 8)])
def test_demo_trains_with_the_deepspeed_config(runs, micro, devices):
  out = runs[f"deepspeed_{micro}_{devices}"]
  assert out.returncode == 0, out.stdout + out.stderr
  assert "global batch 32 = 4 micro-batch(es)" in out.stdout
  rows = _rows(out.log)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  for r in rows:
    assert r["loss_scale"] >= 2.0 ** 15 and "grad_norm" in r
    assert 0 < r["loss"] < 10 and "learning_rate" in r
  # The flags as used: the config's (its CPU offload too), not the
  # defaults it replaces.
  (run,) = [l for l in out.stdout.splitlines() if l.startswith("run: ")]
  for used in ("'stage': 2", "'compute_dtype': 'float16'",
               "'batch_size': 32", "'grad_accum_steps': 4",
               "'clip_grad_norm': None", "'offload_optimizer': 'host'"):
    assert used in run, (used, run)
  assert "clipping: none" in out.stdout
  assert "norm None" not in out.stdout


def test_the_config_contradicts_itself_on_8_devices():
  # micro 8 x accum 4 x 8 devices is not 32: an error before any compile.
  config = zj.from_deepspeed(DEEPSPEED)
  with pytest.raises(ValueError, match="batch sizes contradict"):
    zj.Engine(lambda p, b: 0.0, None, config, zj.make_mesh(num_devices=8))
  # Its NVMe path is read once the device says "nvme" (the NVMe tier).
  nvme = json.loads(json.dumps(DEEPSPEED))
  nvme["zero_optimization"]["offload_optimizer"]["device"] = "nvme"
  with pytest.warns(UserWarning):
    config = zj.from_deepspeed(nvme)
  assert (config.offload_optimizer, config.nvme_path, config.update_on) == (
      "nvme", "/local_nvme/deepspeed", "host")


def test_demo_resumes_at_another_stage_and_device_count(runs, tmp_path):
  out = runs["eight"]
  assert out.returncode == 0, out.stdout + out.stderr
  ckpt = str(out.log.parent / "ckpt")
  losses = {r["step"]: r["loss"] for r in _rows(out.log)}
  assert sorted(zj.Checkpointer(ckpt).all_steps()) == [4, 6]
  # Back to step 4 (as if killed before step 6 was saved), then resumed in
  # a new process at stage 0 on 1 device with the same --steps (same
  # schedule and data): steps 5 and 6 repeat their losses.
  shutil.rmtree(os.path.join(ckpt, "6"))
  log = tmp_path / "resumed.jsonl"
  out = subprocess.run(
      [sys.executable, _DEMO, "--devices", "1", "--skip-memory-table",
       "--steps", "6", *_TINY, "--log-jsonl", str(log), "--checkpoint-dir",
       ckpt, "--stage", "0", "--export-params", str(tmp_path / "export")],
      env=dict(os.environ, PYTHONPATH=_ROOT), capture_output=True, text=True,
      timeout=300)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "resumed from step 4" in out.stdout
  resumed = {r["step"]: r["loss"] for r in _rows(log)}
  assert sorted(resumed) == [5, 6]
  for step, loss in resumed.items():
    assert abs(loss - losses[step]) <= 1e-5 * abs(losses[step])
  assert "exported the parameters (float32)" in out.stdout


def test_the_gpu_preset_runs_on_cpu_at_a_shrunk_size(runs):
  # The preset a GPU picks by itself: bf16, remat chosen by compiled peak,
  # the chunked loss (cuDNN attention only exists in GPU programs).
  out = runs["gpu"]
  assert out.returncode == 0, out.stdout + out.stderr
  assert "'compute_dtype': 'bfloat16'" in out.stdout  # (the run: line)
  assert "remat auto chose none" in out.stdout
  assert "loss_chunk=16" in out.stdout
  rows = _rows(out.log)
  assert [r["step"] for r in rows] == [1, 2] and 0 < rows[-1]["loss"] < 10


def _tables(stdout):
  """{title: [state (measured) MiB at stages 0-3]} of the printed tables."""
  tables, title = {}, None
  for line in stdout.splitlines():
    if line.startswith("Per-device memory of the "):
      title = line
      tables[title] = []
    elif title and re.match(r"\s+\d \|", line):
      tables[title].append(float(line.split("|")[2]))
  return tables


@compiles_for_gpus
def test_on_one_device_the_table_is_also_compiled_for_8_h100s(runs):
  # One device: every stage holds the whole state, so the demo compiles the
  # same step for 8 compile-only H100s (zero_jax.analysis), where ZeRO
  # shards it.
  out = runs["table"]
  assert out.returncode == 0, out.stdout + out.stderr
  tables = _tables(out.stdout)
  (one,) = [v for k, v in tables.items() if "N = 1 devices" in k]
  (h100,) = [v for k, v in tables.items()
             if "compiled for 8 x H100 (compile-only: zero_jax.analysis)" in k
             and "N = 8 devices" in k]
  assert len(one) == 4 and len(set(one)) == 1, one
  assert len(h100) == 4, h100
  # Stage 0 replicates everything, as on one device; each stage then shards
  # more (stages 1 and 2 hold the same state: gradients are temporaries).
  assert h100[0] == one[0]
  assert h100[0] > h100[1] >= h100[2] > h100[3], h100
  assert h100[3] < h100[0] / 4, h100


# ------------------------------------------------ a plain install; talking


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_demo_trains_in_low_precision_on_one_device(runs, dtype):
  # On a plain `pip install -e .` (no CUDA plugin), the GPT's
  # attention="auto" once traced cuDNN's attention and raised "cuDNN is not
  # detected." (CI's plain-install leg runs this.)
  out = runs[dtype]
  assert out.returncode == 0, out.stdout + out.stderr
  assert f"'compute_dtype': '{dtype}'" in out.stdout  # (the run: line)
  rows = _rows(out.log)
  assert [r["step"] for r in rows] == [1, 2] and 0 < rows[-1]["loss"] < 10


def test_demo_prints_the_step_1_loss_and_each_table_compile(runs):
  # (One run for both: the README quotes the step-1 loss, and the memory
  # table's compiles are said as they finish. The run of the H100 test
  # above: its first table is the one compiled on its own device.)
  out = runs["table"]
  assert out.returncode == 0, out.stdout + out.stderr
  (line,) = [l for l in out.stdout.splitlines() if l.startswith("step 1 ")]
  printed = float(re.match(r"step 1 loss (\d+\.\d{4}) \(compile \+ first "
                           r"step \d+\.\ds\)$", line).group(1))
  assert printed == pytest.approx(_rows(out.log)[0]["loss"], abs=5e-5)
  lines = out.stdout.splitlines()
  start = lines.index("memory table of the compiled train step: compiling "
                      "the step at stages 0-3")
  for stage in range(4):
    assert re.match(rf"  stage {stage} compiled \(\d+\.\ds\)$",
                    lines[start + 1 + stage]), lines[start:start + 5]
  # Each said before the table it makes is printed.
  assert any(l.startswith("Per-device memory of the compiled train step")
             for l in lines[start + 5:])


def test_demo_says_its_python_and_prints_a_sampled_continuation(runs):
  # The training text is the running Python's standard library; greedy
  # decoding of the small model once printed 100 underscores.
  out = runs["table"]
  assert out.returncode == 0, out.stdout + out.stderr
  assert (f"the Python {platform.python_version()} standard library's "
          "source") in out.stdout
  lines = out.stdout.splitlines()
  (i,) = [i for i, l in enumerate(lines) if l.startswith("sample (")]
  assert "sampled at temperature 0.8 with key 0" in lines[i]
  sample = "\n".join(lines[i + 1:])
  continuation = sample[sample.index(">>>") + 3:].split("\ntraining done")[0]
  assert len(set(continuation)) > 5, continuation


def test_demo_checks_plots_dependency_before_training(runs):
  # matplotlib made unimportable, as on a plain install.
  out = runs["no_matplotlib"]
  assert out.returncode == 2, out.stdout + out.stderr
  assert 'pip install -e ".[plot]"' in out.stderr, out.stderr
  assert "--plot needs matplotlib" in out.stderr
  assert not out.log.exists() and "devices:" not in out.stdout  # no work


@pytest.mark.parametrize("flags,named", CONTRADICTIONS)
def test_demo_refuses_contradictory_flags(runs, flags, named):
  out = runs[f"flags{CONTRADICTIONS.index((flags, named))}"]
  assert out.returncode == 2, out.stdout + out.stderr
  (error,) = [l for l in out.stderr.splitlines() if "error:" in l]
  for name in named:
    assert name in error, error
  assert out.stdout == ""


def test_the_launcher_runs_the_demo_as_docs_multi_host_says(runs, tmp_path):
  # docs/multi-host.md's command, tiny: 2 processes x 4 CPU devices, each
  # feeding its rows; the same losses as one process on 8 devices (the
  # first run of the resume test above, same flags). (The preset "auto"
  # once listed the devices before initialize().)
  log = tmp_path / "launched.jsonl"
  proc = subprocess.run(
      [sys.executable, "-m", "zero_jax.launch", "--nproc", "2",
       "--devices-per-proc", "4", _DEMO, "--steps", "6", *_TINY,
       "--log-jsonl", str(log)],
      cwd=_ROOT, env=dict(os.environ, PYTHONPATH=_ROOT),
      capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
  assert "[0] step 1 loss" in proc.stdout
  assert "[1] step 1 loss" not in proc.stdout  # process 0 prints
  one = runs["eight"]
  assert one.returncode == 0, one.stdout + one.stderr
  launched = _rows(log)
  assert [r["step"] for r in launched] == [1, 2, 3, 4, 5, 6]
  for a, b in zip(launched, _rows(one.log)):
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
