"""`main.py info --param_groups`: the per-parameter optimizer table, abstractly, for full K3."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_info_optimizer_table_for_k3_without_allocating():
  out = subprocess.run([sys.executable, "main.py", "info", "--config=k3", "--param_groups",
                        "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-2000:]
  table = json.loads(out.stdout.strip().splitlines()[-1])
  assert table["optimizer"] == "muon"          # the k3 preset's default
  rows = {r["path"]: r for r in table["params"]}
  r = rows["units/layers/3/ffn/w_gate"]
  assert r["shape"] == [22, 896, 7168 // 2, 3072]
  assert (r["group"], r["batch_axes"]) == ("per-expert Muon", ["layers", "experts"])
  assert rows["units/layers/0/mixer/q_proj/w"]["group"] == "per-head Muon"
  assert rows["units/layers/0/mixer/q_proj/w"]["batch_axes"] == ["layers", "heads"]
  assert rows["units/layers/0/mixer/o_proj/w"]["group"] == "Muon"
  assert rows["embed/table"]["group"] == "AdamW" and rows["lm_head/w"]["group"] == "AdamW"
  assert {r["group"] for r in table["params"]} == {"per-head Muon", "per-expert Muon", "Muon",
                                                   "AdamW"}
