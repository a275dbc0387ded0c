"""The command line, end to end, in subprocesses: info, train (k3_tiny, a few steps),
generate from its checkpoint, and the errors users meet first."""

import json
import os
import subprocess
import sys


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


def test_train_generate_and_refuse_other_config(tmp_path):
  wd = str(tmp_path / "run")
  r = _main("train", "--config=k3_tiny", "--steps=3", "--eval_every=3", f"--workdir={wd}",
            "--learning_rate=0.004", "--profile_steps=3:3")
  assert r.returncode == 0, r.stderr[-3000:]
  # Observability (tests/test_goodput.py checks the values): a trace, goodput fields.
  assert "profile of steps 3-3 written to" in r.stdout and "\ngoodput " in r.stdout
  lines = [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]
  assert [l["step"] for l in lines] == [1, 2, 3] and "eval_loss" in lines[-1]
  # k3_tiny trains with AdamW alone: its rate is logged (warmup from 0, then <= the peak).
  assert [l["lr_adamw"] for l in lines][0] == 0.0 and 0 < lines[-1]["lr_adamw"] <= 0.004
  assert "lr_muon" not in lines[-1]
  assert lines[-1]["time_steps"] > 0 and 0 < lines[-1]["goodput"] <= 1
  assert "step     3/3" in r.stdout
  assert os.path.isdir(os.path.join(wd, "checkpoints", "3"))
  assert json.load(open(os.path.join(wd, "train_config.json")))["learning_rate"] == 0.004

  r = _main("generate", f"--workdir={wd}", "--prompt=def ", "--max_new_tokens=8")
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.startswith("def ")

  r = _main("train", "--config=k3_tiny", "--override=d_model=48", "--steps=3",
            f"--workdir={wd}")
  assert r.returncode == 2 and "different model config" in r.stderr and "d_model" in r.stderr
  assert os.path.isdir(os.path.join(wd, "checkpoints", "3"))       # nothing lost


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
