"""Serving engine benchmarks on k3_small (random weights; timings do not depend on them).

  python -m benchmarks.serve [--quick] [--json out.json] [--config k3_small]

(--only picks sections: ttft, decode, throughput, vs_transformers.)

1. Time to first token, hit vs miss: 4,096-token prompts sharing their first 3,584 tokens.
   A first request (miss) fills the prefix cache; a second one with another 512-token tail
   hits 3,584 tokens (the KDA checkpoint at that boundary + 7 MLA pages) and prefills 512.
   Both are timed in one run, after warm-up requests that compile every shape.
   Target: hit / miss <= 0.15.
2. Decode time per token at 1K vs 32K tokens of context, for the hybrid model and for the
   same model with every layer MLA. The engine's decode step has fixed shapes: it attends
   over a power-of-two bucket of pages (at least 4,096 tokens) covering the longest
   sequence, so one engine (max_len 32,768, one slot) is timed with its slot at context
   1,024 and at 32,760 (no 32K prefill is needed to time it: the work of the step is the
   same whatever the cached values). The paged attention reads only the pages up to the
   longest position (a loop over pages with a dynamic trip count), so the step grows by
   the latent bytes it reads: the printed bound is the 1K step plus the extra KV bytes at
   the read bandwidth measured in the same run, over the 1K step. Target: hybrid 32K / 1K
   <= 1.1 where that bound allows it; at or near the bound otherwise.
3. Throughput: the same 8 requests (128-token prompts, 32 new tokens each, greedy) through
   an engine with 1 slot, one with 8 slots, and one with 8 slots whose prefill batches the
   prompts' same-size pieces into one call (batch_invariant=False); and 1 slot without host
   overlap (overlap=False), for what dispatching one step ahead gains. Target: >= 6x tokens/s.

4. vs transformers: greedy tokens/s of the engine and of transformers' generate on the same
   converted 15M-parameter Kimi-Linear, batch 1 and 8 (bench_vs_transformers), and the
   decode step at batch 1 against one read of its weights at the bandwidth measured here.
   Targets: >= 4x at batch 1, >= 8x at batch 8, step <= 3x the weight read.

--quick: 2 timed decode steps, 16 new tokens in the throughput case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import configs  # noqa: E402
from k3_jax import train  # noqa: E402
from k3_jax.config import apply_overrides, validate  # noqa: E402
from k3_jax.model import create_model  # noqa: E402
from k3_jax.config import SINGLE_STREAM  # noqa: E402
from k3_jax.serve.engine import Engine, SamplingParams  # noqa: E402


def weights(config, overrides):
  cfg = validate(apply_overrides(configs.get(config), overrides))
  return (cfg, *train.split_model(create_model(cfg, seed=0)))


def ttft(eng, prompt):
  req = eng.submit(prompt, SamplingParams(max_tokens=1))
  eng.run_until_done([req])
  return req.first_token_at - req.arrival, req.cached_tokens


def bench_ttft(config):
  cfg, g, p, r = weights(config, ["max_seq_len=8192"])
  eng = Engine(cfg, g, p, r, SINGLE_STREAM, max_len=4096 + 512, prefix_cache_bytes=64 << 20)
  rng = np.random.default_rng(0)
  tok = lambda n: rng.integers(1, cfg.vocab_size, n).astype(np.int32)
  warm = tok(3584)
  ttft(eng, np.concatenate([warm, tok(512)]))               # compiles the miss path
  ttft(eng, np.concatenate([warm, tok(512)]))               # compiles the hit path
  shared = tok(3584)
  miss, c0 = ttft(eng, np.concatenate([shared, tok(512)]))
  hit, c1 = ttft(eng, np.concatenate([shared, tok(512)]))
  assert c0 == 0 and c1 == 3584, (c0, c1)
  return {"ttft_miss_s": miss, "ttft_hit_s": hit, "ttft_ratio": hit / miss,
          "cached_tokens": c1}


def decode_step_time(eng, pos, runs):
  """Median seconds of the engine's decode step with one slot at context `pos`."""
  from k3_jax.serve.engine import DECODE_MIN_PAGES
  from k3_jax.serve import steps
  from k3_jax.serve.kv_pages import PAGE
  b = eng.max_batch
  if not eng.tables[0].any():
    eng.tables[0] = eng.pool.alloc(eng.pages_per_slot)
  need = pos // PAGE + 1
  bucket = min(eng.pages_per_slot, max(DECODE_MIN_PAGES, 1 << (need - 1).bit_length()))
  z, zf = np.zeros(b, np.int32), np.zeros(b, np.float32)
  sampling = steps.Sampling(z, z, zf, np.ones(b, np.float32), zf, zf, eng._no_bias[b])
  batch = lambda: steps.DecodeBatch(z, np.full(b, pos, np.int32), eng.tables[:, :bucket].copy(),
                                    np.ones(b, bool), sampling, z, np.zeros(b, bool))
  times = []
  for i in range(runs + 1):                       # the first call compiles
    t0 = time.perf_counter()
    out = eng._steps.decode(eng.params, eng.rest, eng.cache, eng.counts, batch())
    jax.block_until_ready(out)
    eng.cache, eng.counts = out[1], out[2]
    if i:
      times.append(time.perf_counter() - t0)
  return statistics.median(times)


def bench_decode(config, runs):
  from k3_jax.serve.kv_pages import PAGE
  res = {}
  base = configs.get(config)
  all_mla = "mla_layers=(" + ",".join(str(i + 1) for i in range(base.num_layers)) + ",)"
  for name, ov in (("hybrid", []), ("all_mla", [all_mla])):
    cfg, g, p, r = weights(config, ["max_seq_len=32768"] + ov)
    eng = Engine(cfg, g, p, r, SINGLE_STREAM, max_len=32768)
    short = decode_step_time(eng, 1024, runs)
    long = decode_step_time(eng, 32768 - 8, runs)
    bw = read_bandwidth()
    extra = (32768 - 8 - 1024) * eng.page_bytes / PAGE      # latent bytes the 32K step adds
    res[name] = {"decode_1k_s": short, "decode_32k_s": long, "ratio": long / short,
                 "kv_bytes_32k": 32768 * eng.page_bytes / PAGE, "bandwidth_bytes_s": bw,
                 "ratio_bound": (short + extra / bw) / short}
  return res


def bench_throughput(config, new_tokens):
  """8 requests through 1 slot, 8 slots, and 8 slots with batched prefill
  (batch_invariant=False: the 8 prompts' same-size pieces share a call)."""
  cfg, g, p, r = weights(config, [])
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, cfg.vocab_size, 128).astype(np.int32) for _ in range(8)]
  res, outs = {}, {}
  for name, slots, invariant, overlap in (
      ("1_slots_no_overlap", 1, True, False), ("1_slots", 1, True, True),
      ("8_slots", 8, True, True), ("8_slots_batched_prefill", 8, False, True)):
    eng = Engine(cfg, g, p, r, SINGLE_STREAM, max_batch=slots, max_len=512,
                 batch_invariant=invariant, overlap=overlap)
    warm = [eng.submit(q, SamplingParams(max_tokens=4)) for q in prompts[:slots]]
    eng.run_until_done(warm)                                  # compiles
    t0 = time.perf_counter()
    reqs = [eng.submit(q, SamplingParams(max_tokens=new_tokens)) for q in prompts]
    eng.run_until_done(reqs)
    dt = time.perf_counter() - t0
    res[f"tokens_per_s_{name}"] = sum(len(q.output_ids) for q in reqs) / dt
    outs[name] = [q.output_ids for q in reqs]
  base = res["tokens_per_s_1_slots"]
  res["ratio"] = res["tokens_per_s_8_slots"] / base
  res["ratio_batched_prefill"] = res["tokens_per_s_8_slots_batched_prefill"] / base
  res["overlap_gain_1_slot"] = base / res["tokens_per_s_1_slots_no_overlap"]
  res["same_tokens"] = all(o == outs["1_slots"] for o in outs.values())
  return res


def read_bandwidth(mb: int = 64, runs: int = 10) -> float:
  """This machine's memory read bandwidth (bytes/s): numpy sums of a `mb` MB array."""
  a = np.ones(mb * 2**20 // 8)
  a.sum()
  t0 = time.perf_counter()
  for _ in range(runs):
    a.sum()
  return a.nbytes * runs / (time.perf_counter() - t0)


def bench_vs_transformers(quick):
  """Greedy decode tokens/s of the engine vs transformers' generate on the same converted
  15M-parameter Kimi-Linear (benchmarks/vs_transformers.py's model): 8 distinct 512-token
  prompts, 64 new tokens each, at batch 1 (one request at a time / one generate call per
  prompt) and batch 8 (8 slots / one generate call over the 8 prompts). Both include their
  prefill, as a client sees it. Also the engine's decode step at batch 1 (context 576)
  next to the time to read its weights once at the bandwidth measured in the same run."""
  import tempfile
  import torch
  from benchmarks.vs_transformers import build_pair
  from k3_jax.serve import steps
  from k3_jax.serve.kv_pages import PAGE
  new = 16 if quick else 64
  with tempfile.TemporaryDirectory() as tmp:
    hf, cfg, ours = build_pair(tmp, [])
  hf.eval()
  hf.generation_config.eos_token_id = None
  hf.generation_config.pad_token_id = 0
  g, p, r = train.split_model(ours)
  weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(p))
  rng = np.random.default_rng(5)
  prompts = [rng.integers(1, cfg.vocab_size, 512).astype(np.int32) for _ in range(8)]
  res = {"weight_bytes": weight_bytes, "new_tokens": new}

  def hf_run(batch):
    outs = []
    with torch.no_grad():
      for i in range(0, 8, batch):
        ids = torch.tensor(np.stack(prompts[i:i + batch]), dtype=torch.long)
        out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        outs += [list(map(int, o[512:])) for o in out]
    return outs

  def ours_run(eng, batch):
    outs = []
    for i in range(0, 8, batch):
      reqs = [eng.submit(q, SamplingParams(max_tokens=new)) for q in prompts[i:i + batch]]
      eng.run_until_done(reqs)
      outs += [q.output_ids for q in reqs]
    return outs

  with torch.no_grad():                                       # transformers' warm-up
    hf.generate(torch.tensor(prompts[:1], dtype=torch.long), max_new_tokens=2, do_sample=False)
  for batch in (1, 8):
    eng = Engine(cfg, g, p, r, SINGLE_STREAM, max_batch=batch, max_len=1024,
                 prefix_cache_bytes=0)
    ours_run(eng, batch)                                      # compiles every shape
    t0 = time.perf_counter()
    mine = ours_run(eng, batch)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = hf_run(batch)
    t_hf = time.perf_counter() - t0
    res[f"batch{batch}"] = {
        "ours_tok_s": 8 * new / t_ours, "transformers_tok_s": 8 * new / t_hf,
        "ratio": t_hf / t_ours,
        "same_greedy_tokens": float(np.mean([a == b for a, b in zip(mine, theirs)]))}
  # the decode step alone, batch 1, vs one read of the weights
  eng = Engine(cfg, g, p, r, SINGLE_STREAM, max_batch=1, max_len=1024, prefix_cache_bytes=0)
  step = decode_step_time(eng, 576, 5 if quick else 20)
  bw = read_bandwidth()
  res["decode_step_b1_s"] = step
  res["bandwidth_bytes_s"] = bw
  res["step_vs_weight_read"] = step / (weight_bytes / bw)
  return res


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default="k3_small")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--json", default=None)
  ap.add_argument("--only", default="ttft,decode,throughput,vs_transformers")
  a = ap.parse_args()
  only = a.only.split(",")
  out = {"config": a.config, "devices": str(jax.devices()[0].platform),
         "cpus": os.cpu_count()}
  if "ttft" in only:
    out["ttft"] = bench_ttft(a.config)
    t = out["ttft"]
    print(f"TTFT 4096-token prompt, 3584 shared: miss {t['ttft_miss_s']:.3f} s, hit "
          f"{t['ttft_hit_s']:.3f} s, ratio {t['ttft_ratio']:.3f} (target <= 0.15)", flush=True)
  if "decode" in only:
    out["decode"] = bench_decode(a.config, 2 if a.quick else 5)
    for k, v in out["decode"].items():
      print(f"decode/token {k:8s} 1K {v['decode_1k_s'] * 1e3:8.1f} ms  32K "
            f"{v['decode_32k_s'] * 1e3:8.1f} ms  ratio {v['ratio']:.2f}  (bound "
            f"{v['ratio_bound']:.2f}: {v['kv_bytes_32k'] / 1e6:.1f} MB of latents at 32K, "
            f"{v['bandwidth_bytes_s'] / 1e9:.1f} GB/s)", flush=True)
  if "throughput" in only:
    out["throughput"] = bench_throughput(a.config, 16 if a.quick else 32)
    t = out["throughput"]
    print(f"throughput 8 requests: 1 slot {t['tokens_per_s_1_slots']:.1f} tok/s, 8 slots "
          f"{t['tokens_per_s_8_slots']:.1f} tok/s (ratio {t['ratio']:.2f}), 8 slots with batched "
          f"prefill {t['tokens_per_s_8_slots_batched_prefill']:.1f} tok/s (ratio "
          f"{t['ratio_batched_prefill']:.2f}; target >= 6), same tokens: {t['same_tokens']}; "
          f"1 slot without host overlap {t['tokens_per_s_1_slots_no_overlap']:.1f} tok/s "
          f"(overlap gains {t['overlap_gain_1_slot']:.2f}x)", flush=True)
  if "vs_transformers" in only:
    out["vs_transformers"] = t = bench_vs_transformers(a.quick)
    for b in (1, 8):
      v = t[f"batch{b}"]
      print(f"vs transformers, batch {b}: ours {v['ours_tok_s']:.1f} tok/s, transformers "
            f"{v['transformers_tok_s']:.1f} tok/s, ratio {v['ratio']:.2f}; same greedy "
            f"tokens in {v['same_greedy_tokens']:.0%} of requests", flush=True)
    print(f"decode step batch 1: {t['decode_step_b1_s'] * 1e3:.2f} ms = "
          f"{t['step_vs_weight_read']:.2f}x one read of the {t['weight_bytes'] / 1e6:.1f} MB "
          f"of weights at {t['bandwidth_bytes_s'] / 1e9:.1f} GB/s", flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
