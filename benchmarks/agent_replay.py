"""Agent-trace replay: the prefix cache's tiers on multi-turn agent sessions (k3_small, CPU).

  python -m benchmarks.agent_replay [--sessions 12] [--turns 12] [--quick] [--json out.json]

N sessions run concurrently through one engine (4 slots), each for many turns. Every
session's first prompt is a system prompt + tool declarations shared by all sessions, then
a user message; each later turn sends the conversation back: the previous prompt, the
previous answer (the generated ids, as the chat template renders them back: see
serve/turn_cache.py), a tool result and a short user message. Between turns each session
thinks (a random pause). Token ids are random (the weights are random too; timings do not
depend on either), with one seed per run, so every configuration replays the same sessions
(their answers are the model's greedy tokens).

The sizes are an agent's scaled down about 8x to fit a CPU (k3_small prefills ~750 tokens
a second on 2 cores): a 1,536-token system prompt + tools (a coding agent's are ~12k), tool
results of 32-256 tokens (a few hundred to a few thousand), 12 turns reaching ~3.9k tokens
(tens of thousands). What sets the hit rate is the share of a turn's prompt that is new
(its tool result, user message, and the part of the previous turn past the last 64-token
match boundary), against the context sent back, and that share is kept. max_len holds a
whole session (no session is cut short). The ceiling (below) is 92.5% on the default
sessions; with the earlier 4 turns of 128-1,024-token tool results capped at 4,096 it was
69%: a session's first turns, and the large tool results against short contexts, were most
of its prompt tokens. --quick: 4 sessions x 6 turns (a smoke run of ~4 minutes; its
ceiling is 88.6%, and its 4 sessions fit the device cache, so it does not show the tiers).

Configurations, each one engine of the same shapes (one compile for all):
  no cache         every prompt prefilled from scratch (use_prefix_cache=False)
  device           the device prefix cache alone, its budget the pages the 4 running
                   requests pin and a little more; the sessions' working set (the
                   pages of their last contexts) is about twice that
  device+host      + a host-memory tier of a quarter of the working set
  device+host+disk + a disk tier (a temporary directory)

Reported per configuration: the hit rate over prompt tokens (cached_tokens / prompt tokens,
all tiers), the ceiling (prompt tokens on the match grid that an earlier request already
sent or generated, fed: what a cache of unlimited size could hit), TTFT p50 / p99 (arrival
to first token, queueing included), and the input cost at K3's prices ($0.30 per million
hit tokens, $3.00 per million missed). Then, on the disk-tier engine: the time to restore a
session's cached context from host memory and from disk against prefilling it (restore =
promotion of its blocks into device memory, waited for), and a restart: a new engine on the
same disk directory (after the first one wrote its blocks there, as a draining server does)
answers one session's next turn, and its cached tokens are printed.

Measured (12-04, shared 2-core CPU, defaults; docs/serving.md has the table): hit rate
0 / 67.9 / 78.3 / 92.1% of prompt tokens (ceiling 92.5%), TTFT p50 6.37 / 2.44 / 1.43 /
0.77 s, input cost 1.00 / 0.39 / 0.30 / 0.17x no cache; restore 4.4% (host) and 6.1%
(disk) of prefilling the same tokens; after a restart the first returning turn hit 3,456
of 3,523 tokens. About 7 minutes in all (the no-cache replay ~2).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from benchmarks.serve import weights  # noqa: E402
from k3_jax.serve.engine import Engine, SamplingParams  # noqa: E402
from k3_jax.serve.prefix_cache import block_hashes  # noqa: E402

HIT_PRICE, MISS_PRICE = 0.30, 3.00         # $ per million input tokens
MATCH = 64                                   # prefix match grid of every cached engine
SYSTEM = 1536                               # shared system prompt + tool declarations
USER = 16                                   # a user message
TOOL = (32, 256)                            # a tool result's tokens (uniform range)
ANSWER = 16                                 # generated tokens per turn
THINK = (0.2, 1.0)                          # seconds between a turn's answer and the next


def session_len(turns: int) -> int:
  """Positions the longest session of `turns` turns needs (its last prompt + answer)."""
  return SYSTEM + USER + (turns - 1) * (ANSWER + TOOL[1] + USER) + ANSWER


class Session:
  def __init__(self, k: int, system: np.ndarray, seed: int, turns: int, max_len: int):
    self.k, self.rng = k, np.random.default_rng(seed * 1000 + k)
    self.context = np.concatenate([system, self.rng.integers(1, 256, USER)]).astype(np.int32)
    self.turns_left, self.max_len = turns, max_len
    self.next_at = 0.0
    self.req = None

  def grow(self, answer: list[int]) -> bool:
    """The next turn's prompt: + the answer, a tool result, a user message; False when it
    would not fit (the session ends)."""
    tool = self.rng.integers(*TOOL)
    more = [np.asarray(answer, np.int32), self.rng.integers(1, 256, tool).astype(np.int32),
            self.rng.integers(1, 256, USER).astype(np.int32)]
    nxt = np.concatenate([self.context] + more)
    if nxt.size + ANSWER > self.max_len:
      return False
    self.context = nxt
    return True


def replay(eng: Engine, sessions: int, turns: int, seed: int, use_cache: bool
           ) -> tuple[dict, list]:
  """-> (the figures, each session's last (prompt, answer))."""
  rng = np.random.default_rng(seed)
  system = rng.integers(1, 256, SYSTEM).astype(np.int32)
  live = [Session(k, system, seed, turns, eng.max_len) for k in range(sessions)]
  for s in live:
    s.next_at = rng.uniform(0, THINK[1])
  seen: set[bytes] = set()
  done, ceiling, last = [], 0, [None] * sessions
  t0 = time.monotonic()
  while live:
    now = time.monotonic() - t0
    for s in live:
      if s.req is None and now >= s.next_at:
        hs = block_hashes(s.context, MATCH)
        known = 0
        while known < len(hs) and hs[known] in seen:
          known += 1
        ceiling += min(known * MATCH, s.context.size - 1)
        seen.update(hs)
        s.req = eng.submit(s.context, SamplingParams(max_tokens=ANSWER),
                           use_prefix_cache=use_cache)
    if eng.has_work():
      eng.step()
    else:
      time.sleep(0.005)
    for s in list(live):
      r = s.req
      if r is not None and r.state == "done":
        assert not r.error, r.error
        done.append((r.prompt.size, r.cached_tokens, r.first_token_at - r.arrival))
        fed = np.concatenate([s.context, np.asarray(r.output_ids[:-1], np.int32)])
        seen.update(block_hashes(fed, MATCH))      # (the decoded-turn cache registers these)
        last[s.k] = (s.context, list(r.output_ids))
        s.req = None
        s.turns_left -= 1
        if s.turns_left == 0 or not s.grow(r.output_ids):
          live.remove(s)
        else:
          s.next_at = time.monotonic() - t0 + rng.uniform(*THINK)
  prompt = sum(p for p, _, _ in done)
  hit = sum(c for _, c, _ in done)
  ttft = np.array([t for _, _, t in done])
  return {"requests": len(done), "prompt_tokens": prompt, "hit_tokens": hit,
          "hit_rate": hit / prompt, "ceiling": ceiling / prompt,
          "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
          "cost": (hit * HIT_PRICE + (prompt - hit) * MISS_PRICE) / 1e6,
          "wall_s": time.monotonic() - t0}, last


def restore_vs_prefill(eng: Engine, context: np.ndarray) -> dict:
  """Seconds to restore `context`'s cached blocks from the host tier and from disk (the
  promotion into device memory, waited for) against prefilling the same tokens."""
  t = eng.tiers
  hs = block_hashes(context, MATCH)
  out = {}
  for tier in ("host", "disk"):
    while eng.prefix._evict_one():          # everything off the device (demoted)
      pass
    if tier == "disk":
      t.disk.flush()
      t.host.blocks.clear()
      t.host.used = 0
    jax.block_until_ready(eng.cache)
    t0 = time.perf_counter()
    got = t.promote(hs, len(hs), step=-2)
    jax.block_until_ready((eng.cache, eng.ckpts))
    out[f"restore_{tier}_s"] = time.perf_counter() - t0
    out[f"restore_{tier}_tokens"] = len(got) * MATCH
  n = out["restore_host_tokens"]
  best = []
  for _ in range(2):
    req = eng.submit(context[:n + 1], SamplingParams(max_tokens=1), use_prefix_cache=False)
    eng.run_until_done([req])
    best.append(req.first_token_at - req.arrival)
  out["prefill_s"] = min(best)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default="k3_small")
  ap.add_argument("--sessions", type=int, default=12)
  ap.add_argument("--turns", type=int, default=12)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", default=None)
  ap.add_argument("--override", action="append", default=[],
                  help="a model config override, e.g. dtype=bfloat16 (repeatable)")
  ap.add_argument("--quick", action="store_true", help="4 sessions x 6 turns (a smoke run)")
  args = ap.parse_args()
  if args.quick:
    args.sessions, args.turns = 4, 6
  max_len = -(-session_len(args.turns) // 512) * 512       # holds a whole session
  cfg, g, p, r = weights(args.config, [f"max_seq_len={max_len}"] + args.override)
  probe = Engine(cfg, g, p, r, max_batch=1, max_len=512, prefix_cache_bytes=0)
  block = probe.page_bytes
  # the sessions' working set: the pages of their last contexts (and a checkpoint each);
  # the device cache holds the pages the 4 running requests pin and a little more (a
  # promotion needs room beside them), the host tier a quarter of the working set
  last = SYSTEM + USER + (args.turns - 1) * (ANSWER + sum(TOOL) // 2 + USER)
  pages = -(-last // 512)
  working = args.sessions * (pages * block + probe.ckpt_bytes)
  device = (4 * pages + 8) * block + 16 * probe.ckpt_bytes
  tiers = {"no cache": {}, "device": {}, "device+host": {"host_cache_bytes": working // 4},
           "device+host+disk": {"host_cache_bytes": working // 4}}
  tmp = tempfile.mkdtemp(prefix="k3_agent_replay_")
  tiers["device+host+disk"]["disk_cache_dir"] = tmp
  steps, rows, engines = None, {}, {}
  print(f"{args.config}: {args.sessions} sessions x {args.turns} turns, 4 slots, "
        f"max_len {max_len}, match grid {MATCH}; device prefix cache {device / 2**20:.1f} MiB, "
        f"host tier {working // 4 / 2**20:.1f} MiB, sessions' working set ~{working / 2**20:.0f}"
        f" MiB")
  # warm-up: one replay on a throwaway engine compiles every shape the runs use
  for name, kw in [("warm-up", {})] + list(tiers.items()):
    eng = Engine(cfg, g, p, r, max_batch=4, max_len=max_len, prefix_cache_bytes=device,
                 prefix_match_tokens=MATCH, **kw)
    if steps is not None:
      eng.runner.steps = steps
    steps = eng.runner.steps
    t0 = time.monotonic()
    if name == "warm-up":      # every prefill piece size (512, 256, 64, 16, 4, 1), cold and hit
      warm = np.random.default_rng(9).integers(1, 256, 512 + 256 + 64 + 16 + 4 + 1)
      for _ in range(2):
        eng.run_until_done([eng.submit(warm.astype(np.int32), SamplingParams(max_tokens=2))])
    got, last = replay(eng, args.sessions if name != "warm-up" else 2,
                       args.turns if name != "warm-up" else 3,
                       args.seed + (name == "warm-up"), name != "no cache")
    if name == "warm-up":
      print(f"warm-up (compiles): {time.monotonic() - t0:.0f} s")
      continue
    rows[name], engines[name] = got, eng
    if eng.tiers is not None:
      got["tiers"] = {k: v.hit_tokens for k, v in eng.tiers.stats.items()}
      got["tier_summary"] = eng.tiers.summary()
    print(f"{name:>17}: {got['requests']} requests, {got['prompt_tokens']} prompt tokens, "
          f"hit {got['hit_rate']:.1%} (ceiling {got['ceiling']:.1%}), ttft p50 "
          f"{got['ttft_p50']:.3f} s p99 {got['ttft_p99']:.3f} s, input ${got['cost']:.4f}, "
          f"{got['wall_s']:.0f} s" + (f", hit tokens by tier {got['tiers']}"
                                       if "tiers" in got else ""), flush=True)
  eng = engines["device+host+disk"]
  s = eng.tiers.stats
  tier_rows = {k: vars(v) for k, v in s.items()}
  print("per tier (device+host+disk):", json.dumps(tier_rows))
  # a restart: the first engine writes its device and host blocks to disk (as a draining
  # server does), a new one on the same directory answers a returning session
  eng.tiers.persist()
  again = Engine(cfg, g, p, r, max_batch=4, max_len=max_len, prefix_cache_bytes=device,
                 prefix_match_tokens=MATCH, **tiers["device+host+disk"])
  again.runner.steps = steps
  context, answer = last[0]                 # session 0's next turn: + its answer, a user message
  back = np.concatenate([context, np.asarray(answer, np.int32),
                         np.random.default_rng(1).integers(1, 256, USER).astype(np.int32)])
  req = again.submit(back, SamplingParams(max_tokens=ANSWER))
  again.run_until_done([req])
  restart = {"prompt_tokens": int(req.prompt.size), "cached_tokens": int(req.cached_tokens),
             "disk_blocks": len(again.tiers.disk.index)}
  print(f"restart: {restart['disk_blocks']} blocks reloaded; the first returning turn "
        f"({restart['prompt_tokens']} tokens) hit {restart['cached_tokens']}")
  rs = restore_vs_prefill(eng, last[1][0])
  print(f"restore {rs['restore_host_tokens']} tokens: from host {rs['restore_host_s']:.3f} s, "
        f"from disk {rs['restore_disk_s']:.3f} s; prefill {rs['prefill_s']:.3f} s "
        f"(host {rs['restore_host_s'] / rs['prefill_s']:.1%}, disk "
        f"{rs['restore_disk_s'] / rs['prefill_s']:.1%} of recomputing)")
  base = rows["no cache"]
  print("\n| configuration | hit rate (ceiling) | TTFT p50 | TTFT p99 | input cost | vs no cache |")
  print("|---|---|---|---|---|---|")
  for name, got in rows.items():
    print(f"| {name} | {got['hit_rate']:.1%} ({got['ceiling']:.1%}) | {got['ttft_p50']:.3f} s "
          f"| {got['ttft_p99']:.3f} s | ${got['cost']:.4f} | "
          f"{got['cost'] / base['cost']:.2f}x cost, {got['ttft_p50'] / base['ttft_p50']:.2f}x "
          f"TTFT p50 |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"rows": rows, "tiers": tier_rows, "restart": restart, "restore": rs}, f,
                indent=1)


if __name__ == "__main__":
  main()
