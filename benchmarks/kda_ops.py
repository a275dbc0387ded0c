"""Throughput of the KDA reference ops: chunk_kda vs recurrent_kda.

  python -m benchmarks.kda_ops [--quick] [--lengths 4096] [--chunk-size C] [--json out.json]
                               [--runs N]

Measures tokens/s for the forward pass and forward+backward (jax.grad of a
scalar of the outputs w.r.t. q, k, v, g, beta) at B=1, H=4, K=V=128, float32,
T in {1024, 4096, 16384} (--quick: T=1024 only), jit-compiled, one warm-up
call, then the median of --runs timed calls (block_until_ready). It also
measures a 2048x2048 float32 jnp.dot in the same process, before and after the
KDA timings (the best of the two: the machine's dense-matmul peak in this run, on
a shared machine), and reports achieved GFLOP/s as a share of it.

Analytic FLOP counts (multiply and add counted separately, per token per head;
exp, masks and reshapes not counted):

  recurrent (per token): decay K*V + read k^T S 2*K*V + write 2*K*V
                         + output S^T q 2*K*V                   = 7*K*V
  chunk (per token, C = chunk (--chunk-size; 0 = 16, the reference default),
         t = tile = 16, sub-tile 4):
    intra-chunk scores, q and k, between tiles as dense
      [2t, K] x [K, C] per tile                                = 4*C*K
    inside tiles, [8, K] x [K, t] per 4-token sub-tile         = 4*t*K
    triangular solve, C x C against K+V right-hand sides       = C*(K+V)
    scan: W S, q S, k^T Vnew (2*K*V each) + Aqk Vnew (2*C*V)    = 6*K*V + 2*C*V
  forward+backward is counted as 3x the forward (the usual 1 fwd + 2 bwd).

Achieved GFLOP/s = FLOPs / median time, with two FLOP counts: the analytic one
above and XLA's count for the compiled program (cost_analysis). XLA counts a
while loop's body once, not once per trip: its count covers chunk's parallel
work (every multiply-add of the masked tile products included) but not its scan
over chunks, and next to nothing of the recurrent scan. The ratio column is
chunk tokens/s over recurrent tokens/s for the same T and pass.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.timing import time_fn  # noqa: E402
from k3_jax.ops import kda  # noqa: E402

B, H, K, V = 1, 4, 128, 128
CHUNK = 64
SUB_TILE = 16


def flops_recurrent(T):
  return 7 * K * V * B * H * T


def flops_chunk(T, C=CHUNK, t=SUB_TILE):
  per_token = 4 * C * K + 4 * t * K + C * (K + V) + 6 * K * V + 2 * C * V
  return per_token * B * H * T


def make_inputs(T, key):
  ks = jax.random.split(key, 6)
  q = kda.l2_normalize(jax.random.normal(ks[0], (B, T, H, K)))
  k = kda.l2_normalize(jax.random.normal(ks[1], (B, T, H, K)))
  v = jax.random.normal(ks[2], (B, T, H, V))
  z = jax.random.normal(ks[3], (B, T, H, K))
  g = kda.kda_gate_lower_bound(z, jnp.zeros((H,)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
  return q, k, v, g, beta


def build(op):
  def fwd(q, k, v, g, beta):
    o, s = op(q, k, v, g, beta, output_final_state=True)
    return o, s

  def loss(q, k, v, g, beta):
    o, s = op(q, k, v, g, beta, output_final_state=True)
    return jnp.sum(o) + jnp.sum(s)

  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def xla_flop_count(fn, args) -> float:
  """FLOPs XLA counts for the compiled program of the jitted fn on args."""
  cost = fn.lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float(cost.get("flops", 0.0))


def bench_matmul(runs):
  n = 2048
  a = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.PRNGKey(2), (n, n), jnp.float32)
  dot = jax.jit(jnp.dot)
  sec = time_fn(dot, (a, b), runs)
  return 2 * n ** 3 / sec / 1e9


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="T=1024 only")
  p.add_argument("--lengths", default=None,
                 help="comma-separated sequence lengths (default 1024,4096,16384)")
  p.add_argument("--json", default=None, help="write results to this file")
  p.add_argument("--runs", type=int, default=3, help="timed runs (median)")
  p.add_argument("--chunk-size", type=int, default=0,
                 help="chunk_kda chunk length; 0 = the reference backend's default "
                      "(k3_jax.ops.kda.CHUNK_BY_BACKEND)")
  args = p.parse_args()
  C = kda.resolve_chunk_size(args.chunk_size, "reference")

  lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths
             else [1024] if args.quick else [1024, 4096, 16384])
  ops = {"chunk": (functools.partial(kda.chunk_kda, chunk_size=C),
                   functools.partial(flops_chunk, C=C)),
         "recurrent": (kda.recurrent_kda, flops_recurrent)}
  compiled = {name: build(op) for name, (op, _) in ops.items()}

  matmul_gflops = bench_matmul(args.runs)
  rows = []
  for T in lengths:
    inputs = make_inputs(T, jax.random.PRNGKey(T))
    res = {}
    for pass_name, idx, mult in (("fwd", 0, 1), ("fwd+bwd", 1, 3)):
      for name, (_, flop_fn) in ops.items():
        sec = time_fn(compiled[name][idx], inputs, args.runs)
        xla_flops = xla_flop_count(compiled[name][idx], inputs)
        res[(pass_name, name)] = dict(
            T=T, op=name, pass_=pass_name, seconds=sec, tokens_per_s=B * T / sec,
            gflops=mult * flop_fn(T) / sec / 1e9, xla_gflop=xla_flops / 1e9,
            xla_gflops=xla_flops / sec / 1e9)
        print(f"  T={T:6d} {pass_name:8s} {name:10s} {sec * 1e3:9.1f} ms",
              file=sys.stderr, flush=True)
      ratio = (res[(pass_name, "chunk")]["tokens_per_s"]
               / res[(pass_name, "recurrent")]["tokens_per_s"])
      for name in ops:
        res[(pass_name, name)]["chunk_over_recurrent"] = ratio
    rows.extend(res.values())

  matmul_gflops = max(matmul_gflops, bench_matmul(args.runs))     # after: the better of two
  print(f"\njnp.dot 2048x2048 f32 (the machine's matmul peak, same run): "
        f"{matmul_gflops:.1f} GFLOP/s (backend {jax.default_backend()}, {os.cpu_count()} CPUs); "
        f"chunk_kda chunk_size={C}\n")
  print("| T | pass | op | ms | tokens/s | GFLOP/s | % of dot | XLA GFLOP | XLA GFLOP/s "
        "| % of dot | chunk/recurrent |")
  print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['T']} | {r['pass_']} | {r['op']} | {r['seconds'] * 1e3:.1f} "
          f"| {r['tokens_per_s']:,.0f} | {r['gflops']:.2f} "
          f"| {100 * r['gflops'] / matmul_gflops:.1f}% "
          f"| {r['xla_gflop']:.2f} | {r['xla_gflops']:.2f} "
          f"| {100 * r['xla_gflops'] / matmul_gflops:.1f}% "
          f"| {r['chunk_over_recurrent']:.2f}x |")

  if args.json:
    out = dict(config=dict(B=B, H=H, K=K, V=V, chunk=C, dtype="float32",
                           backend=jax.default_backend(), runs=args.runs),
               matmul_gflops=matmul_gflops,
               results=[{("pass" if k_ == "pass_" else k_): v_
                         for k_, v_ in r.items()} for r in rows])
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)


if __name__ == "__main__":
  main()
