"""Multi-host serving on this machine: `main.py serve` as 1 process x 8 CPU devices and as
2 processes x 4 (jax.distributed on localhost, gloo collectives), side by side in one run.

    python -m benchmarks.multihost_serve [--tokens=64] [--batch=8] [--json]

For each layout: start the server (k3_tiny, random weights, --mesh=expert:-1), warm it up
(the prefill and decode compiles), then time
  - one greedy stream of --tokens tokens: the decode step time (time between chunks after
    the first, median);
  - --batch concurrent greedy requests of --tokens tokens: tokens per second;
and, for 2 x 4, what the step relay (k3_jax/serve/relay.py) published, from /metrics: plans,
bytes and seconds per plan, and plans per engine step.

CPU collectives (gloo over loopback) stand in for ICI/DCN here, so 2 x 4 pays a cost a TPU
slice does not; the plan cost (a key-value write to the coordinator per relayed call) is
the part that carries over.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import tempfile
import time

import httpx

from tests.serve.serverproc import metric_value, start_group, stop_group

FLAGS = ["--config=k3_tiny", "--random_weights", "--max_batch=8", "--max_len=512",
         "--prefix_cache_bytes=0", "--mesh=expert:-1", "--peer_timeout=30"]


def _body(prompt: str, n: int, stream: bool = False) -> dict:
  return {"model": "k3_tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
          "stream": stream}


async def _stream_gaps(client, n: int) -> list[float]:
  stamps = []
  async with client.stream("POST", "/v1/completions", json=_body("time me", n, True)) as r:
    async for line in r.aiter_lines():
      if line.startswith("data: {"):
        stamps.append(time.perf_counter())
  return [b - a for a, b in zip(stamps[1:], stamps[2:])]


async def _batch(client, n: int, batch: int) -> tuple[int, float]:
  t0 = time.perf_counter()
  rs = await asyncio.gather(*[client.post("/v1/completions", json=_body(f"request {i}", n))
                              for i in range(batch)])
  took = time.perf_counter() - t0
  return sum(r.json()["usage"]["completion_tokens"] for r in rs), took


def _grew(name: str, before: str, after: str) -> float:
  """How much the counter `name` grew between two /metrics pages (0 where absent)."""
  return (metric_value(after, f"{name}_total", 0.0)
          - metric_value(before, f"{name}_total", 0.0))


async def _measure(base: str, tokens: int, batch: int) -> dict:
  async with httpx.AsyncClient(base_url=base, timeout=600) as client:
    await _batch(client, 4, batch)                      # compiles
    await _stream_gaps(client, 8)
    before = (await client.get("/metrics")).text
    gaps = await _stream_gaps(client, tokens)
    mid = (await client.get("/metrics")).text
    made, took = await _batch(client, tokens, batch)
    after = (await client.get("/metrics")).text
  out = {"decode_step_ms": 1e3 * statistics.median(gaps),
         "batch_tokens_per_s": made / took, "batch_tokens": made}
  plans = _grew("k3_relay_plans", before, mid)
  if plans:
    out.update(stream_plans=plans, plans_per_token=plans / (len(gaps) + 2),
               plan_bytes=_grew("k3_relay_plan_bytes", before, mid) / plans,
               plan_ms=1e3 * _grew("k3_relay_send_seconds", before, mid) / plans,
               batch_plans=_grew("k3_relay_plans", mid, after))
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=64)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--json", action="store_true")
  args = ap.parse_args()
  rows = {}
  for name, (nproc, ndev) in {"1x8": (1, 8), "2x4": (2, 4)}.items():
    d = pathlib.Path(tempfile.mkdtemp(prefix=f"k3mh{name}"))
    t0 = time.perf_counter()
    procs, base, _ = start_group(nproc, ndev, d, FLAGS)
    start = time.perf_counter() - t0
    try:
      rows[name] = {"startup_s": start, **asyncio.run(_measure(base, args.tokens, args.batch))}
    finally:
      stop_group(procs)
  one, two = rows["1x8"], rows["2x4"]
  rows["ratio_2x4_over_1x8"] = {
      "decode_step": two["decode_step_ms"] / one["decode_step_ms"],
      "batch_throughput": two["batch_tokens_per_s"] / one["batch_tokens_per_s"]}
  if args.json:
    print(json.dumps(rows, indent=1))
    return
  for name in ("1x8", "2x4"):
    r = rows[name]
    print(f"{name}: start-up {r['startup_s']:.1f} s, decode step {r['decode_step_ms']:.2f} ms "
          f"(one stream), {args.batch} requests: {r['batch_tokens_per_s']:.1f} tokens/s")
  if "plan_ms" in two:
    print(f"2x4 relay: {two['plans_per_token']:.2f} plans per decode step, "
          f"{two['plan_bytes']:.0f} bytes and {two['plan_ms']:.3f} ms per plan")
  r = rows["ratio_2x4_over_1x8"]
  print(f"2x4 / 1x8: decode step {r['decode_step']:.2f}x, batch throughput "
        f"{r['batch_throughput']:.2f}x")


if __name__ == "__main__":
  main()
