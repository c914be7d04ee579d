"""The demo trains from a DeepSpeed config, as a migrating user brings it."""

import json
import os
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
# The demo's smallest model.
_TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len",
         "16"]


def _run_demo(tmp_path, config, devices, steps=4, *extra, table=False,
              python=(sys.executable,)):
  args = ["--devices", str(devices), *extra]
  if not table:
    args.append("--skip-memory-table")
  if config is not None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    args += ["--deepspeed-config", str(path)]
  log = tmp_path / f"metrics{len(list(tmp_path.glob('*.jsonl')))}.jsonl"
  env = dict(os.environ, PYTHONPATH=_ROOT)
  out = subprocess.run(
      [*python, _DEMO, *args, "--steps", str(steps), *_TINY,
       "--log-jsonl", str(log)],
      env=env, capture_output=True, text=True, timeout=300)
  return out, log


def _rows(log):
  return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("micro,devices", [(8, 1), (1, 8)])
def test_demo_trains_with_the_deepspeed_config(tmp_path, micro, devices):
  config = dict(DEEPSPEED, train_micro_batch_size_per_gpu=micro)
  out, log = _run_demo(tmp_path, config, devices)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "global batch 32 = 4 micro-batch(es)" in out.stdout
  assert "offload_optimizer='host'" in out.stdout
  rows = _rows(log)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  for r in rows:
    assert r["loss_scale"] >= 2.0 ** 15 and "grad_norm" in r
    assert 0 < r["loss"] < 10 and "learning_rate" in r


def test_the_config_contradicts_itself_on_8_devices():
  # micro 8 x accum 4 x 8 devices is not 32: an error before any compile.
  config = zj.from_deepspeed(DEEPSPEED)
  with pytest.raises(ValueError, match="batch sizes contradict"):
    zj.Engine(lambda p, b: 0.0, None, config, zj.make_mesh(num_devices=8))
  nvme = json.loads(json.dumps(DEEPSPEED))
  nvme["zero_optimization"]["offload_optimizer"]["device"] = "nvme"
  with pytest.raises(ValueError, match="nvme"):
    zj.from_deepspeed(nvme)


def test_demo_resumes_at_another_stage_and_device_count(tmp_path):
  ckpt = str(tmp_path / "ckpt")
  out, log = _run_demo(tmp_path, None, 8, 6, "--checkpoint-dir", ckpt,
                       "--save-every", "2", "--keep", "2")
  assert out.returncode == 0, out.stdout + out.stderr
  losses = {json.loads(r)["step"]: json.loads(r)["loss"]
            for r in log.read_text().splitlines()}
  assert sorted(zj.Checkpointer(ckpt).all_steps()) == [4, 6]
  # Back to step 4 (as if killed before step 6 was saved), then resumed at
  # stage 0 on 1 device with the same --steps (same schedule and data):
  # steps 5 and 6 repeat their losses.
  shutil.rmtree(os.path.join(ckpt, "6"))
  out, log = _run_demo(tmp_path, None, 1, 6, "--checkpoint-dir", ckpt,
                       "--stage", "0", "--export-params",
                       str(tmp_path / "export"))
  assert out.returncode == 0, out.stdout + out.stderr
  assert "resumed from step 4" in out.stdout
  resumed = {json.loads(r)["step"]: json.loads(r)["loss"]
             for r in log.read_text().splitlines()}
  assert sorted(resumed) == [5, 6]
  for step, loss in resumed.items():
    assert abs(loss - losses[step]) <= 1e-5 * abs(losses[step])
  assert "exported the parameters (float32)" in out.stdout


def test_the_gpu_preset_runs_on_cpu_at_a_shrunk_size(tmp_path):
  # The preset a GPU picks by itself: bf16, remat chosen by compiled peak,
  # the chunked loss (cuDNN attention only exists in GPU programs).
  out, log = _run_demo(tmp_path, None, 8, 2, "--preset", "gpu",
                       "--batch-size", "16", "--loss-chunk", "16")
  assert out.returncode == 0, out.stdout + out.stderr
  assert "compute_dtype='bfloat16'" in out.stdout
  assert "remat auto chose none" in out.stdout
  assert "loss_chunk=16" in out.stdout
  rows = [json.loads(line) for line in log.read_text().splitlines()]
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
def test_on_one_device_the_table_is_also_compiled_for_8_h100s(tmp_path):
  # One device: every stage holds the whole state, so the demo compiles the
  # same step for 8 compile-only H100s (zero_jax.analysis), where ZeRO
  # shards it.
  out, _ = _run_demo(tmp_path, None, 1, 2, "--batch-size", "16",
                     table=True)
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
def test_demo_trains_in_low_precision_on_one_device(tmp_path, dtype):
  # On a plain `pip install -e .` (no CUDA plugin), the GPT's
  # attention="auto" once traced cuDNN's attention and raised "cuDNN is not
  # detected." (CI's plain-install leg runs this.)
  out, log = _run_demo(tmp_path, None, 1, 2, "--compute-dtype", dtype)
  assert out.returncode == 0, out.stdout + out.stderr
  assert f"compute_dtype='{dtype}'" in out.stdout
  rows = _rows(log)
  assert [r["step"] for r in rows] == [1, 2] and 0 < rows[-1]["loss"] < 10


def test_demo_prints_the_step_1_loss_and_each_table_compile(tmp_path):
  # (One run for both: the README quotes the step-1 loss, and the memory
  # table's compiles are said as they finish.)
  out, log = _run_demo(tmp_path, None, 8, 2, table=True)
  assert out.returncode == 0, out.stdout + out.stderr
  (line,) = [l for l in out.stdout.splitlines() if l.startswith("step 1 ")]
  printed = float(re.match(r"step 1 loss (\d+\.\d{4}) \(compile \+ first "
                           r"step \d+\.\ds\)$", line).group(1))
  assert printed == pytest.approx(_rows(log)[0]["loss"], abs=5e-5)
  lines = out.stdout.splitlines()
  start = lines.index("memory table of the compiled train step: compiling "
                      "the step at stages 0-3")
  for stage in range(4):
    assert re.match(rf"  stage {stage} compiled \(\d+\.\ds\)$",
                    lines[start + 1 + stage]), lines[start:start + 5]
  # Each said before the table it makes is printed.
  assert any(l.startswith("Per-device memory of the compiled train step")
             for l in lines[start + 5:])


def test_demo_checks_plots_dependency_before_training(tmp_path):
  # matplotlib made unimportable, as on a plain install.
  blocked = (sys.executable, "-c",
             "import runpy, sys; sys.modules['matplotlib'] = None; "
             "sys.argv = sys.argv[1:]; "
             "runpy.run_path(sys.argv[0], run_name='__main__')")
  out, log = _run_demo(tmp_path, None, 8, 2, "--plot",
                       str(tmp_path / "m.png"), table=True, python=blocked)
  assert out.returncode == 2, out.stdout + out.stderr
  assert 'pip install -e ".[plot]"' in out.stderr, out.stderr
  assert "--plot needs matplotlib" in out.stderr
  assert not log.exists() and "devices:" not in out.stdout  # no work done


@pytest.mark.parametrize("flags,named", [
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
])
def test_demo_refuses_contradictory_flags(flags, named):
  out = subprocess.run([sys.executable, _DEMO, *flags],
                       env=dict(os.environ, PYTHONPATH=_ROOT),
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stdout + out.stderr
  (error,) = [l for l in out.stderr.splitlines() if "error:" in l]
  for name in named:
    assert name in error, error
  assert out.stdout == ""


def test_the_launcher_runs_the_demo_as_docs_multi_host_says(tmp_path):
  # docs/multi-host.md's command, tiny: 2 processes x 4 CPU devices, each
  # feeding its rows; the same losses as one process on 8 devices. (The
  # preset "auto" once listed the devices before initialize().)
  log = tmp_path / "launched.jsonl"
  proc = subprocess.run(
      [sys.executable, "-m", "zero_jax.launch", "--nproc", "2",
       "--devices-per-proc", "4", _DEMO, "--steps", "2", *_TINY,
       "--log-jsonl", str(log)],
      cwd=_ROOT, env=dict(os.environ, PYTHONPATH=_ROOT),
      capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
  assert "[0] step 1 loss" in proc.stdout
  assert "[1] step 1 loss" not in proc.stdout  # process 0 prints
  out, one = _run_demo(tmp_path, None, 8, 2)
  assert out.returncode == 0, out.stdout + out.stderr
  launched = _rows(log)
  assert [r["step"] for r in launched] == [1, 2]
  for a, b in zip(launched, _rows(one)):
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
