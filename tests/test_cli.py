"""The command line, end to end, in subprocesses: info, train (a 2-layer k3_tiny, a few steps),
generate from its checkpoint, and the errors users meet first."""

import glob
import json
import os
import subprocess
import sys

from tests.faults.faultcli import MODEL, RUN, STEPS

TIMES = ("time_compile", "time_init", "time_data", "time_steps", "time_eval",
         "time_checkpoint")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(*args, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)          # one CPU device, as a user would have
  return subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout)


def test_info_k3_json():
  r = _main("info", "--config=k3", "--json")
  assert r.returncode == 0, r.stderr
  out = json.loads(r.stdout)
  assert 2.75e12 < out["total_params"] < 2.83e12
  assert 100e9 < out["active_params"] < 108e9
  assert out["layers"] == 93 and len(out["mla_layers"]) == 24


def test_unknown_config_is_a_clear_error():
  r = _main("info", "--config=k9")
  assert r.returncode == 2
  assert "k3_small" in r.stderr and "k9" in r.stderr


def test_unknown_override_field_is_named():
  r = _main("info", "--config=k3_tiny", "--override=kda.heads=2")
  assert r.returncode == 2 and "heads" in r.stderr


def test_train_generate_and_refuse_other_config(tmp_path, env):
  # The fault tests' 2-layer k3_tiny run in the session's compilation cache (conftest `env`):
  # the same programs as their reference run, so they are compiled once per session.
  wd = str(tmp_path / "run")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), "train", *RUN,
                      f"--workdir={wd}", "--profile_steps=3:4"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  lines = [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]
  assert [l["step"] for l in lines] == list(range(1, STEPS + 1)) and "eval_loss" in lines[-1]
  # k3_tiny trains with AdamW alone: its rate is logged (warmup from 0, then <= the peak).
  peak = json.load(open(os.path.join(wd, "train_config.json")))["learning_rate"]
  assert [l["lr_adamw"] for l in lines][0] == 0.0 and 0 < lines[-1]["lr_adamw"] <= peak
  assert "lr_muon" not in lines[-1]
  assert f"step     {STEPS}/{STEPS}" in r.stdout
  assert os.path.isdir(os.path.join(wd, "checkpoints", str(STEPS)))
  tc = json.load(open(os.path.join(wd, "train_config.json")))
  assert (tc["steps"], tc["batch_size"], tc["seq_len"]) == (STEPS, 2, 32)   # the flags given
  # Observability: the --profile_steps trace (TensorBoard's xplane and Perfetto's json,
  # non-empty, under <workdir>/profile) and the goodput fields of every metrics line:
  # cumulative (non-decreasing), disjoint spans summing to no more than the wall time
  # (1e-3: the 4-digit rounding), goodput = time_steps / wall_time; a summary line.
  assert "profile of steps 3-4 written to" in r.stdout and "\ngoodput " in r.stdout
  files = glob.glob(os.path.join(wd, "profile", "**", "*"), recursive=True)
  traces = [f for f in files if f.endswith((".xplane.pb", "perfetto_trace.json.gz"))]
  assert len(traces) == 2 and all(os.path.getsize(f) > 0 for f in traces), files
  prev = dict.fromkeys(TIMES, 0.0)
  for rec in lines:
    assert all(rec[k] >= prev[k] >= 0 for k in TIMES), rec
    assert sum(rec[k] for k in TIMES) <= rec["wall_time"] + 1e-3, rec
    assert abs(rec["goodput"] - rec["time_steps"] / rec["wall_time"]) <= 1e-3
    assert 0 < rec["goodput"] <= 1
    prev = {k: rec[k] for k in TIMES}
  assert lines[-1]["time_checkpoint"] > 0 and lines[-1]["time_init"] > 0

  r = _main("generate", f"--workdir={wd}", "--prompt=def ", "--max_new_tokens=4")
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.startswith("def ")

  r = _main("train", *MODEL, "--override=d_model=48", f"--steps={STEPS}", f"--workdir={wd}")
  assert r.returncode == 2 and "different model config" in r.stderr and "d_model" in r.stderr
  assert os.path.isdir(os.path.join(wd, "checkpoints", str(STEPS)))       # nothing lost


def test_generate_without_checkpoint_is_a_clear_error(tmp_path):
  r = _main("generate", f"--workdir={tmp_path}", "--prompt=x")
  assert r.returncode == 2 and "no checkpoints" in r.stderr


def test_a_flag_of_another_command_is_refused():
  r = _main("info", "--config=k3_tiny", "--temperature=0.5")
  assert r.returncode == 2 and "--temperature: not a flag of `info`" in r.stderr
  assert "--serving_bytes" in r.stderr            # followed by info's own flags


def test_help_lists_the_command_flags():
  r = _main("compile", "--help")
  assert r.returncode == 0
  flags = {l.split(":")[0].strip() for l in r.stdout.splitlines() if l.startswith("  --")}
  assert {"--topology", "--step", "--expert_format", "--mesh"} <= flags
  assert "--temperature" not in flags and "--prompt" not in flags
