"""`main.py compile`: ahead-of-time compilation of the real steps for a TPU topology from
this CPU machine (compile-only devices from libtpu), with the per-chip memory report.

Default suite: the k3_tiny decode step on v5p-8 (4 chips), and a deliberately too-big
config (k3_tiny with huge routed experts: 12 MoE layers x 64 experts x 3 x 4096 x 65536
f32 = 2.4 TB over 4 chips) that must report fits=false. The train step (forward, backward
and optimizer: several minutes of TPU compiling here) is marked slow."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2 ** 30


def _compile(*args, timeout=900):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  r = subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), "compile", "--json",
                      *args], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=timeout)
  assert r.returncode == 0, r.stderr[-4000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def _check_report(rep):
  assert rep["chip_hbm_bytes"] == 95 * GiB and rep["chips"] == 4
  parts = (rep["argument_bytes"] + rep["output_bytes"] - rep["alias_bytes"] + rep["temp_bytes"]
           + rep["generated_code_bytes"])
  assert rep["per_chip_total_bytes"] == parts > 0
  assert rep["fits"] == (rep["per_chip_total_bytes"] <= rep["chip_hbm_bytes"])


def test_compile_decode_k3_tiny_v5p():
  rep = _compile("--config=k3_tiny", "--topology=v5p-8", "--step=decode",
                 "--global_batch=8", "--seq_len=64")
  _check_report(rep)
  assert rep["fits"] and rep["mesh"]["fsdp"] == 4 and rep["step"] == "decode"
  assert rep["flops_per_chip"] > 0
  # The donated cache comes back in place: outputs alias it.
  assert rep["alias_bytes"] > 0


def test_compile_reports_a_config_that_does_not_fit():
  rep = _compile("--config=k3_tiny", "--topology=v5p-8", "--step=decode",
                 "--global_batch=8", "--seq_len=64", "--override=moe.num_experts=64",
                 "--override=moe.latent_dim=4096", "--override=moe.expert_intermediate=65536")
  assert rep["fits"] is False
  assert rep["per_chip_total_bytes"] > 95 * GiB        # ~600 GB of expert weights per chip
  assert rep["chip_hbm_bytes"] == 95 * GiB


@pytest.mark.slow
def test_compile_train_k3_tiny_v5p():
  rep = _compile("--config=k3_tiny", "--topology=v5p:2x2x1", "--step=train",
                 "--mesh=fsdp:2,expert:2")
  _check_report(rep)
  assert rep["fits"] and rep["step"] == "train"
