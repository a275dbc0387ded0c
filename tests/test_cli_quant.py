"""`main.py info --serving_bytes` and `main.py generate --expert_format=mxfp4`, end to end."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(*args, timeout=1800):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout)

WIDE = ["--override=moe.latent_dim=32", "--override=moe.expert_intermediate=32"]


def test_info_quant_reports_serving_bytes():
  r = _main("info", "--config=k3_tiny", *WIDE, "--serving_bytes", "--json")
  assert r.returncode == 0, r.stderr
  sb = json.loads(r.stdout)["serving_mxfp4"]
  out = json.loads(r.stdout)
  assert sb["routed_expert_params"] == out["routed_expert_params"]
  assert sb["routed_expert_bytes"] * 8 == 4.25 * out["routed_expert_params"]
  assert sb["other_bf16_bytes"] == 2 * (out["total_params"] - out["routed_expert_params"])


@pytest.mark.slow
def test_generate_from_packed_checkpoint(tmp_path):
  wd = str(tmp_path / "run")
  r = _main("train", "--config=k3_tiny", *WIDE, "--override=quant.qat=mxfp4_mxfp8",
            "--steps=2", "--eval_every=2", f"--workdir={wd}")
  assert r.returncode == 0, r.stderr
  gen = lambda *a: _main("generate", f"--workdir={wd}", "--prompt=def ", "--max_new_tokens=8", *a)
  ref, packed = gen(), gen("--expert_format=mxfp4")
  assert ref.returncode == 0 and packed.returncode == 0, packed.stderr
  assert packed.stdout == ref.stdout and packed.stdout.startswith("def ")
