"""Soak: many concurrent clients, cancellations and constant prefix-cache eviction; checks
that nothing drifts or leaks.

    python -m benchmarks.serve_soak                       # 2,000 requests, 32 clients
    python -m benchmarks.serve_soak --requests=200 --clients=8 --json

The engine (5-layer k3_tiny variant of the engine tests, random weights, 8 slots) runs in
its EngineLoop thread, as under `serve`; `--clients` threads submit requests back to back
(the engine API the HTTP handlers call, without the HTTP layer). Prompts are drawn from
`--distinct` prompts of random length (64-1,500 tokens) built from 4 shared 512-token
prefixes, so most requests hit the prefix cache, whose budget makes it evict all the time
(4 blocks with their checkpoints). A warm-up pass over `slots` prompts compiles the step
shapes first, so latencies are serving, not compiling. 10% of the requests are cancelled
after their first token.

Checked: every completed greedy request equals the same prompt's cold output (one request
alone, prefix cache off, computed first); afterwards every slot is free, the only pages in
use are the prefix cache's own, no block or checkpoint is pinned; resident memory from the
500th to the last request grows by at most 5%. Reported: p50 / p99 time to first token and
inter-token latency, evictions, wall time.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time

import numpy as np


def rss_bytes() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  return 0


def build(slots: int, budget_blocks: int):
  from k3_jax.config import SINGLE_STREAM
  from k3_jax.serve.engine import Engine
  from k3_jax.serve.kv_pages import PAGE
  from k3_jax.serve.loader import random_weights
  cfg, g, p, r = random_weights("k3_tiny", ("max_seq_len=2048", "num_layers=5",
                                            "mla_layers=(4,5)"), seed=3)
  probe = Engine(cfg, g, p, r, SINGLE_STREAM, max_len=PAGE)
  budget = budget_blocks * (probe.page_bytes + probe.ckpt_bytes) + 100
  eng = Engine(cfg, g, p, r, max_batch=slots, prefix_cache_bytes=budget, max_len=2048,
               max_queue=4096)
  cold = Engine(cfg, g, p, r, max_batch=slots, prefix_cache_bytes=0, max_len=2048)
  return eng, cold


def prompts(n: int, seed: int = 0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  bases = [rng.integers(1, 256, 512).astype(np.int32) for _ in range(4)]
  out = []
  for _ in range(n):
    base = bases[int(rng.integers(0, 4))]
    length = int(rng.integers(64, 1500))
    tail = rng.integers(1, 256, max(0, length - 512)).astype(np.int32)
    out.append(np.concatenate([base, tail])[:length])
  return out


def pct(xs, q):
  return float(np.percentile(xs, q)) if xs else float("nan")


def soak(requests: int = 2000, clients: int = 32, slots: int = 8, distinct: int = 48,
         max_tokens: int = 8, cancel_frac: float = 0.1, seed: int = 0) -> dict:
  from k3_jax.serve.requests import SamplingParams
  from k3_jax.serve.server import EngineLoop
  eng, cold = build(slots, budget_blocks=4)
  pool = prompts(distinct, seed)
  params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
  t0 = time.monotonic()
  refs = []
  for i in range(0, distinct, slots):          # the cold outputs, one request per slot
    reqs = [cold.submit(q, params, use_prefix_cache=False) for q in pool[i:i + slots]]
    cold.run_until_done(reqs)
    refs += [list(r.output_ids) for r in reqs]
  ref_seconds = time.monotonic() - t0
  del cold
  eng.run_until_done([eng.submit(q, params) for q in pool[:slots]])     # compile the shapes
  loop = EngineLoop(eng)
  rng = random.Random(seed)
  plan = [(rng.randrange(distinct), rng.random() < cancel_frac) for _ in range(requests)]
  lock = threading.Lock()
  state = {"next": 0, "done": 0, "rss": {}, "ttft": [], "itl": [], "completed": 0,
           "cancelled": 0, "failed": 0, "differ": 0, "errors": []}

  def client():
    while True:
      with lock:
        i = state["next"]
        if i >= requests:
          return
        state["next"] += 1
      k, cancel = plan[i]
      stamps = []
      done = threading.Event()

      def on_update(r, delta, stamps=stamps, cancel=cancel):
        stamps.append(time.monotonic())
        if cancel and r.output_ids:
          r.cancel()
          with eng.lock:
            eng.lock.notify_all()
        if r.state == "done":
          done.set()

      req = eng.submit(pool[k], params, on_update=on_update)
      with eng.lock:
        eng.lock.notify_all()
      req.done_event.wait(timeout=600)
      with lock:
        if req.first_token_at is not None:
          state["ttft"].append(req.first_token_at - req.arrival)
        state["itl"] += list(np.diff(stamps)) if len(stamps) > 1 else []
        if req.finish_reason == "cancelled":
          state["cancelled"] += 1
        elif getattr(req, "error", None):
          state["failed"] += 1
          state["errors"].append(str(req.error)[:200])
        else:
          state["completed"] += 1
          if list(req.output_ids) != refs[k]:
            state["differ"] += 1
        state["done"] += 1
        if state["done"] in (500, requests):
          state["rss"][state["done"]] = rss_bytes()

  t1 = time.monotonic()
  threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  wall = time.monotonic() - t1
  deadline = time.monotonic() + 30
  while eng.has_work() and time.monotonic() < deadline:
    time.sleep(0.05)
  loop.stop()
  counts = eng.resource_counts()
  rss = state["rss"]
  growth = (rss[requests] / rss[500] - 1) if 500 in rss and requests in rss else None
  evictions = getattr(eng.prefix, "evictions", None) if eng.prefix is not None else None
  return {"requests": requests, "clients": clients, "slots": slots,
          "completed": state["completed"], "cancelled": state["cancelled"],
          "failed": state["failed"], "differ_from_cold": state["differ"],
          "errors": state["errors"][:5], "resources_after": counts,
          "all_free": (counts["free_slots"] == slots and counts["running"] == 0
                       and counts["waiting"] == 0
                       and counts["used_pages"] == counts["cached_pages"]
                       and counts["pinned_blocks"] == 0 and counts["pinned_checkpoints"] == 0),
          "evictions": evictions,
          "rss_growth_500_to_end": growth,
          "ttft_p50_s": pct(state["ttft"], 50), "ttft_p99_s": pct(state["ttft"], 99),
          "itl_p50_s": pct(state["itl"], 50), "itl_p99_s": pct(state["itl"], 99),
          "wall_s": round(wall, 1), "reference_s": round(ref_seconds, 1)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--requests", type=int, default=2000)
  ap.add_argument("--clients", type=int, default=32)
  ap.add_argument("--slots", type=int, default=8)
  ap.add_argument("--distinct", type=int, default=48)
  ap.add_argument("--json", action="store_true")
  a = ap.parse_args()
  out = soak(a.requests, a.clients, a.slots, a.distinct)
  if a.json:
    print(json.dumps(out))
    return
  for k, v in out.items():
    print(f"{k:24} {v}")


if __name__ == "__main__":
  main()
