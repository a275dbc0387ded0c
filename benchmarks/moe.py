"""Routed-expert compute: dropless grouped-matmul dispatch vs the dense baseline.

  python -m benchmarks.moe [--quick] [--json out.json] [--runs N] [--tokens N]
  python -m benchmarks.moe --tiles 16,32,64,128,256

--tiles: the tile size of the tiled layout's two programs on the served 15M Kimi-Linear's
experts (E=16, k=4, Din=256, F=128) at 512 and 4,096 tokens (one prompt; eight in one
call): `loop` (`_moe_tile_loop`, what a prefill on XLA:CPU runs; default tile
`prefill_tile`) and `batched` (`_moe_tiles_batched`, what training differentiates; default
`_tile_rows`), each (program, tile) timed in turns with the others (the best of 5 rounds
of 3 calls).

For E in {16, 64, 256} experts and k in {2, 8, 16} experts per token (--quick:
E=16, k=2 only), N=2048 tokens, expert input width Din=256, intermediate F=512,
float32 throughout, SiTU-GLU experts, routing from `select_experts` on random
sigmoid scores with zero bias. Three ways to compute y = sum_j p_j FFN_j(x):

  tiled   moe_dispatch(gmm=tiled_gmm)       dropless, per-tile dense matmuls
  ragged  moe_dispatch(gmm=ragged_dot_gmm)  dropless, jax.lax.ragged_dot (XLA:CPU
                                            lowers it to a masked matmul against
                                            every expert)
  dense   moe_dense_reference               every expert on every token, masked

Each is jit-compiled, called once to warm up, then timed as the median of --runs
calls (block_until_ready); cases whose warm-up exceeds 5 s are timed once, and
cases above --max-gflop compiled GFLOPs (500) or --max-temp-gib temp memory (4)
are not timed at all (their FLOP ratio is still reported: on XLA:CPU that is
ragged_dot at large E*k, e.g. 16 GiB temp at E=256, k=16). The
FLOP ratio is the compiled program's cost-analysis "flops" over the analytic
FLOPs of the k selected experts' forward pass:

  analytic = 2 * N * k * (3 * Din * F)     (gate, up, down matmuls; 2 flops per MAC)

(for tiled, whose served program is a loop of run-time length that cost analysis counts
once, the matmul FLOPs of the tiles it runs: `loop_flops`), so 1.0 is ideal; the routing
(top-k, sort, gather) and the GLU add a little, tiled padding adds up to E * (tile - 1) rows, and a dense all-experts method
reads about E / k. Targets: dispatch within 1.3x, dense near E / k.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.timing import time_fn  # noqa: E402
from k3_jax.ops.moe import (moe_dense_reference, moe_dispatch, ragged_dot_gmm,  # noqa: E402
                            select_experts, tiled_gmm)

DIN, F = 256, 512
EXPERTS = (16, 64, 256)
TOP_K = (2, 8, 16)
SLOW_WARMUP_S = 5.0


def analytic_flops(n, k):
  return 2 * n * k * 3 * DIN * F


def loop_flops(ids, e, tile=None):
  """Matmul FLOPs the tiled loop (`moe._moe_tile_loop`) runs for this routing: every tile
  that holds rows, padding rows included, times gate, up and down."""
  from k3_jax.ops import moe
  t = tile or moe.prefill_tile(int(np.asarray(ids).size), e)
  sizes = np.bincount(np.asarray(ids).reshape(-1), minlength=e)
  return float(2 * int(np.sum(-(-sizes // t))) * t * 3 * DIN * F)


def compiled_cost(jitted, args):
  """(flops, temp bytes) of the compiled program. cost_analysis() is a dict in jax 0.10
  (a list of per-module dicts in older versions)."""
  compiled = jitted.lower(*args).compile()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    flops = float(sum(c.get("flops", 0.0) for c in cost))
  else:
    flops = float(cost.get("flops", 0.0))
  mem = compiled.memory_analysis()
  temp = float(getattr(mem, "temp_size_in_bytes", 0) or 0)
  return flops, temp


def make_inputs(n, e, k, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(n, DIN)), jnp.float32)                 # [N, Din]
  scores = jnp.asarray(1.0 / (1.0 + np.exp(-rng.normal(size=(n, e)))), jnp.float32)  # [N, E]
  weights, ids = select_experts(scores, jnp.zeros(e, jnp.float32), k)     # [N, k] x2
  w_gate = jnp.asarray(rng.normal(size=(e, DIN, F)) / np.sqrt(DIN), jnp.float32)
  w_up = jnp.asarray(rng.normal(size=(e, DIN, F)) / np.sqrt(DIN), jnp.float32)
  w_down = jnp.asarray(rng.normal(size=(e, F, DIN)) / np.sqrt(F), jnp.float32)
  return x, weights, ids, w_gate, w_up, w_down


METHODS = {
    "tiled": lambda *a: moe_dispatch(*a, gmm=tiled_gmm),
    "ragged": lambda *a: moe_dispatch(*a, gmm=ragged_dot_gmm),
    "dense": moe_dense_reference,
}


def bench_tiles(tiles):
  """ms of the tiled layout's two programs at each tile size, 512 and 4,096 tokens (module
  docstring)."""
  import time
  from k3_jax.ops import moe
  e, k, din, f = 16, 4, 256, 128
  rng = np.random.default_rng(0)
  w = [jnp.asarray(rng.normal(size=shape) * 0.05, jnp.float32)
       for shape in ((e, din, f), (e, din, f), (e, f, din))]
  programs = {"loop": moe._moe_tile_loop, "batched": moe._moe_tiles_batched}
  for n in (512, 4096):
    x = jnp.asarray(rng.normal(size=(n, din)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
    p = jnp.asarray(rng.random((n, k)), jnp.float32)
    fns = {(name, t): jax.jit(lambda *a, t=t, prog=prog: prog(*a, "situ", 4.0, 25.0, tile=t))
           for name, prog in programs.items() for t in tiles}
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
      fn(x, p, ids, *w).block_until_ready()
    for _ in range(5):
      for key, fn in fns.items():
        t0 = time.perf_counter()
        for _ in range(3):
          fn(x, p, ids, *w).block_until_ready()
        best[key] = min(best[key], (time.perf_counter() - t0) / 3)
    print(f"N={n} (m={n * k} pairs; defaults: loop {moe.prefill_tile(n * k, e)}, batched "
          f"{moe._tile_rows(n * k, e)})", flush=True)
    for name in programs:
      print(f"  {name:8s} " + ", ".join(f"tile {t}: {best[name, t] * 1e3:.1f} ms"
                                          for t in tiles), flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiles", help="comma-separated tile sizes: time the tiled layout "
                      "at each (module docstring) instead of the methods")
  parser.add_argument("--quick", action="store_true", help="E=16, k=2 only")
  parser.add_argument("--json", help="write the rows to this file")
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--tokens", type=int, default=2048)
  parser.add_argument("--max-gflop", type=float, default=500.0,
                      help="only report FLOPs (no timing) above this compiled GFLOP count")
  parser.add_argument("--max-temp-gib", type=float, default=4.0,
                      help="only report FLOPs (no timing) above this compiled temp memory")
  args = parser.parse_args()
  if args.tiles:
    return bench_tiles([int(t) for t in args.tiles.split(",")])

  n = args.tokens
  cases = [(16, 2)] if args.quick else [(e, k) for e in EXPERTS for k in TOP_K if k <= e // 2]
  print(f"backend={jax.default_backend()} devices={len(jax.devices())} N={n} Din={DIN} F={F} "
        f"float32, median of {args.runs} runs\n")
  print("| E | k | method | ms | tokens/s | compiled/analytic FLOPs |")
  print("|---|---|--------|----|----------|-------------------------|")
  rows = []
  for e, k in cases:
    inputs = make_inputs(n, e, k)
    for name, fn in METHODS.items():
      jitted = jax.jit(fn)
      flops, temp = compiled_cost(jitted, inputs)
      if name == "tiled":   # a loop of run-time length: cost analysis counts its body once
        flops = loop_flops(inputs[2], e)
      ratio = flops / analytic_flops(n, k)
      row = {"E": e, "k": k, "method": name, "tokens": n, "din": DIN, "f": F,
             "ms": None, "tokens_per_s": None, "flops_ratio": ratio,
             "compiled_flops": flops, "analytic_flops": analytic_flops(n, k),
             "temp_bytes": temp}
      if flops <= args.max_gflop * 1e9 and temp <= args.max_temp_gib * 2**30:
        sec = time_fn(jitted, inputs, args.runs, slow_warmup_s=SLOW_WARMUP_S)
        row.update(ms=sec * 1e3, tokens_per_s=n / sec)
        timing = f"{sec * 1e3:.1f} | {n / sec:,.0f}"
      else:
        timing = (f"not timed ({flops / 1e9:.0f} GFLOP, {temp / 2**30:.1f} GiB temp) | -")
      rows.append(row)
      print(f"| {e} | {k} | {name} | {timing} | {ratio:.2f} |", flush=True)
    del inputs
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"backend": jax.default_backend(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()
