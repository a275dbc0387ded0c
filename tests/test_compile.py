"""`main.py compile`: ahead-of-time compilation of the real steps for a TPU topology from
this CPU machine (compile-only devices from libtpu), with the per-chip memory report.

Default suite: the k3_tiny decode step on v5p-8 (4 chips) in the preset's pod layout and
k3's layout resolution (no compile). Slow: a deliberately too-big config (k3_tiny with huge
routed experts: 12 MoE layers x 64 experts x 3 x 4096 x 65536 f32 = 2.4 TB over 4 chips)
that must report fits=false. The train step (forward, backward
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


@pytest.mark.slow   # ~30 s AOT compile (suite budget)
def test_compile_verify_k3_tiny_v5p():
  """compile --step=verify lowers speculative decoding's verify step (serve/verify.py) in the
  decode's pod layout: every slot runs its last token and k drafts over the paged cache."""
  rep = _compile("--config=k3_tiny", "--topology=v5p-8", "--step=verify",
                 "--num_speculative_tokens=3")
  _check_report(rep)
  assert rep["pod_layout"] == "k3_tiny: v5p-8 decode" and rep["draft_tokens"] == 3
  assert rep["step"] == "verify" and "verify_step" in rep["step_function"]
  r = rep["roofline"]
  assert r["tokens_per_step"] == rep["global_batch"] and r["step_time_s"] > 0


@pytest.mark.slow   # ~20 s AOT compile (suite budget); compile of the prefill and train steps
# for a TPU topology stays in the default suite
def test_compile_decode_k3_tiny_v5p():
  # No layout flags: k3_tiny's PodLayout for v5p-8 decode gives mesh, batch and length.
  rep = _compile("--config=k3_tiny", "--topology=v5p-8", "--step=decode")
  _check_report(rep)
  assert rep["pod_layout"] == "k3_tiny: v5p-8 decode"
  assert rep["mesh"]["fsdp"] == 2 and rep["mesh"]["expert"] == 2
  assert rep["global_batch"] == 8 and rep["cache_len"] == 64
  assert rep["fits"] and rep["step"] == "decode"
  assert rep["flops_per_chip"] > 0
  r = rep["roofline"]                  # pod/roofline.py, tested on its own there
  assert r["bound"] in ("compute", "hbm", "ici", "dcn") and r["step_time_s"] > 0
  assert r["tokens_per_step"] == 8 and r["tokens_per_s"] == 8 / r["step_time_s"]
  assert 0 < r["mfu"] < 1 and r["hbm_bytes_per_chip"] > 0
  # a decode step reads at least its analytic minimum (weights, touched experts, the cache)
  assert r["hbm_bytes_vs_min"] >= 1 and r["analytic_min_bytes_per_chip"] > 0
  # the Pallas KDA decode kernel is counted from its cost estimate (not a 64-chip v5p node:
  # no comparison with the node target)
  assert r["pallas_kernels"]["kda_decode_step"]["count"] > 0
  assert r["pallas_kernels"]["kda_decode_step"]["flops"] > 0
  assert "target_tokens_per_s" not in r
  # The donated cache comes back in place: outputs alias it.
  assert rep["alias_bytes"] > 0


@pytest.mark.slow   # ~60 s of compiling; fits == (total <= HBM) is checked on every report
def test_compile_reports_a_config_that_does_not_fit():
  # An explicit --mesh wins over the preset's layout (fsdp:2,expert:2).
  rep = _compile("--config=k3_tiny", "--topology=v5p-8", "--step=decode", "--mesh=fsdp:4",
                 "--global_batch=4", "--override=moe.num_experts=64",
                 "--override=moe.latent_dim=4096", "--override=moe.expert_intermediate=65536")
  assert rep["mesh"]["fsdp"] == 4 and rep["mesh"]["expert"] == 1
  assert rep["global_batch"] == 4 and rep["cache_len"] == 64    # the layout's seq_len
  assert rep["fits"] is False
  assert rep["per_chip_total_bytes"] > 95 * GiB        # ~600 GB of expert weights per chip
  assert rep["chip_hbm_bytes"] == 95 * GiB


def test_k3_pod_layout_fills_what_is_not_given():
  """k3's recommended v5p-4096 train layout (however the topology is spelled) fills every
  unset flag; explicit values win; a target without a layout changes nothing."""
  import dataclasses
  import configs
  from k3_jax.compile import LAYOUT_FLAGS, apply_pod_layout, pod_layout
  from pod.topology import resolve_target
  layouts = configs.get_pod_layouts("k3")
  lay = pod_layout(layouts, resolve_target("v5p:8x16x16"), "train")
  assert lay is pod_layout(layouts, resolve_target("v5p-4096"), "train") is not None
  assert pod_layout(layouts, resolve_target("v5p-4096", 2), "train").run.mesh.startswith(
      "data:2")
  assert pod_layout(layouts, resolve_target("v5p-128", 2), "train") is None
  base = configs.get_exec("k3")
  none = dict.fromkeys(LAYOUT_FLAGS)
  kw = apply_pod_layout(lay, base, none)
  assert kw["run"] == lay.run and kw["global_batch"] == lay.global_batch
  assert kw["seq_len"] == lay.seq_len == 8192
  assert kw["run"].remat == "block" and kw["run"].ep_capacity == 1.25
  kw = apply_pod_layout(lay, base, {**none, "mesh": "fsdp:64,expert:32", "remat": "layer",
                                    "ep_capacity": 2.0})
  assert kw["run"] == dataclasses.replace(lay.run, mesh="fsdp:64,expert:32", remat="layer",
                                          ep_capacity=2.0)
  assert kw["global_batch"] == lay.global_batch
  kw = apply_pod_layout(None, base, none)
  assert kw["run"] == base and base.mesh == "" and kw["global_batch"] is None


def test_malloc_arena_cap_yields_to_the_environment(monkeypatch):
  """`compile` caps glibc's malloc arenas (less host memory for the TPU compiler's
  threads); an explicit MALLOC_ARENA_MAX wins."""
  from pod import aot
  monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
  assert aot.limit_malloc_arenas() is False
  monkeypatch.delenv("MALLOC_ARENA_MAX")
  assert aot.limit_malloc_arenas(8) is True        # glibc (Linux): mallopt accepted it


@pytest.mark.slow   # ~30 s of TPU compiling
def test_compile_prefill_of_one_long_sequence_k3_tiny_v5p():
  """One sequence over 4 chips (the k3 1M-token layout in miniature): the engine's
  prefill_step, its tokens split over the expert axis, the paged cache over its pages; the
  next-token logits only."""
  rep = _compile("--config=k3_tiny", "--topology=v5p-8", "--step=prefill", "--mesh=expert:4",
                 "--global_batch=1", "--seq_len=256", "--ep_capacity=2")
  _check_report(rep)
  assert rep["fits"] and rep["global_batch"] == 1 and rep["cache_len"] == 256
  assert rep["step_function"].startswith("k3_jax.serve.steps.prefill_step")
  assert rep["alias_bytes"] > 0              # the donated paged cache comes back in place


@pytest.mark.slow
def test_compile_train_k3_tiny_v5p():
  rep = _compile("--config=k3_tiny", "--topology=v5p:2x2x1", "--step=train",
                 "--mesh=fsdp:2,expert:2")
  _check_report(rep)
  assert rep["fits"] and rep["step"] == "train"
  # every counted FLOP and byte lands in one part of the model (k3_jax/step_costs.py)
  r = rep["roofline"]
  parts = r["parts"]
  assert sum(p["flops"] for p in parts.values()) == pytest.approx(r["flops_per_chip"])
  assert sum(p["hbm_bytes"] for p in parts.values()) == pytest.approx(r["hbm_bytes_per_chip"])
  assert {"moe_experts", "mla_attention_core", "kda_core", "lm_head", "optimizer"} <= set(parts)
  assert parts["optimizer"]["hbm_bytes"] > 0                    # (k3_tiny trains with AdamW)
  assert parts["moe_experts"]["phases"]["backward"]["flops"] > 0   # the tgmm kernel, on TPU


@pytest.mark.slow   # two lowerings of the k3_tiny train step: ~45 s on 2 idle cores
def test_lowered_train_step_does_not_grow_with_the_sequence_split():
  """Guards the compile-memory finding (docs/results.md, compile host memory): the program handed to
  XLA is the same size whatever the sequence split (no per-shard Python loops beyond the
  KCP chain's p small matmuls; collectives counted, not unrolled). k3_tiny's train step on
  the 8 CPU devices, lowered only: sequence 2 vs 4 (fsdp 4 vs 2, same 32 x 64 batch). The
  text may differ by the chain's two extra steps per KDA layer and the larger mesh
  constants, so 15% bounds it (a per-shard unrolling would add ~50% per doubling)."""
  import dataclasses
  import re
  import jax
  import configs
  from k3_jax.compile import train_program
  from sharding.mesh import make_mesh, parse_mesh
  cfg = configs.get("k3_tiny")
  from k3_jax.execution import ExecConfig
  tc = dataclasses.replace(configs.get_train("k3_tiny"), batch_size=8, seq_len=64)
  stats = {}
  for p in (2, 4):
    mesh = make_mesh(parse_mesh(f"fsdp:{8 // p},sequence:{p}"), jax.devices()[:8])
    fn, args = train_program(cfg, tc, mesh, ExecConfig(remat="block"))
    text = fn.lower(*args).as_text()
    stats[p] = (len(text), len(re.findall(r"stablehlo\.all_gather\b", text)),
                len(re.findall(r"stablehlo\.collective_permute\b", text)))
  assert stats[2][1:] == stats[4][1:], stats           # the same collectives
  assert stats[4][0] < 1.15 * stats[2][0], stats


@pytest.mark.slow   # two k3_tiny decode compiles (~1 min)
def test_compile_sweep_k3_tiny(tmp_path):
  """compile --sweep: each point on its layout (batch 8 fills the 4 page shards: pages by
  slot, all-to-all experts at the rule's capacity; batch 2 does not: by length,
  replicated experts), the JSON lines resumed (a second run compiles nothing), the
  frontier and the plot; points too big to hold are skipped without compiling."""
  out, png = tmp_path / "pts.jsonl", tmp_path / "f.png"
  args = ("--config=k3_tiny", "--topology=v5p-8", "--step=decode",
          "--sweep=batch:2,8;cache_len:64", f"--sweep_out={out}", f"--sweep_plot={png}")
  rep = _compile(*args)
  pts = {(p["batch"], p["cache_len"]): p for p in rep["points"]}
  small, big = pts[(2, 64)], pts[(8, 64)]
  assert (small["page_split"], small["expert_exchange"]) == ("column", "replicated")
  assert (big["page_split"], big["expert_exchange"]) == ("slot", "all_to_all")
  assert big["ep_capacity"] > 1 and big["fits"] and big["tokens_per_s"] > 0
  assert big["hbm_vs_min"] >= 1 and big["tpot_s"] == big["step_time_s"]
  assert rep["frontier"] and png.stat().st_size > 1000
  assert len(out.read_text().splitlines()) == 2
  again = _compile(*args)
  assert again["points"] == rep["points"]                 # read back, not compiled again
  huge = _compile(*args[:3], "--sweep=batch:2,8;cache_len:64", "--mesh=fsdp:4",
                  "--override=moe.num_experts=64", "--override=moe.latent_dim=4096",
                  "--override=moe.expert_intermediate=65536")
  assert all(p.get("skipped") and not p["fits"] for p in huge["points"])
