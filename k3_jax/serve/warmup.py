"""Start-up warm-up: the step shapes of ordinary traffic compiled before the server listens.

XLA compiles one program per argument shape, and the engine's shapes follow the load: a
prefill call batches a power-of-two count of prompts (planner.calls), a decode step runs a
power-of-two count of slots (planner.decode_slots). Cold, the first request to meet each
new shape waits for its compile (1-3 s for the 15M Kimi-Linear on 2 CPU cores; minutes
for a large model), in the middle of everyone else's decoding. `warm_up` runs dummy
requests through the engine itself (one page of tokens each; each decodes until the last
of its group has joined the decode, count + 2 tokens) in groups of 1, 2, 4, ... max_batch arriving together, so every prefill row count a step can
batch at a whole page and every decode row count compiles (with --batch_invariant, whose
steps have one shape whatever the load, one request), at the shortest attention window (runner.DECODE_MIN_PAGES pages). Prompt pieces below a page and longer windows
still compile on first use (their shapes are too many to compile ahead).

Nothing of the warm-up is left behind: its requests neither hit nor fill the prefix
cache or its tiers, and the counters that /metrics reports are restored.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from k3_jax.serve.kv_pages import PAGE
from k3_jax.serve.requests import SamplingParams

COUNTERS = (("generated_tokens",), ("roster", "finished_requests"), ("kv", "preemptions"),
            ("speculator", "steps"), ("speculator", "rows"), ("speculator", "drafted"),
            ("speculator", "accepted"))


def prompt_tokens(max_len: int, count: int) -> int:
  """The warm-up prompt's length for a group of `count` requests: a page, or what leaves
  room for its count + 2 generated tokens within max_len (0: the group is skipped)."""
  return max(0, min(PAGE, max_len - count - 2))


def groups(max_batch: int) -> list[int]:
  """The request counts the warm-up submits together: 1, 2, 4, ... and max_batch."""
  out = [1]
  while out[-1] < max_batch:
    out.append(min(2 * out[-1], max_batch))
  return out


@contextlib.contextmanager
def _uncached(engine):
  """The engine with its prefix cache, cache tiers and decoded-turn caching detached, and
  its reported counters restored on exit."""
  def owner(path):
    obj = engine
    for name in path[:-1]:
      obj = getattr(obj, name, None)
    return obj
  owners = [(owner(p), p[-1]) for p in COUNTERS]
  kept = [(obj, name, getattr(obj, name)) for obj, name in owners if hasattr(obj, name)]
  kv, roster = engine.kv, engine.roster
  saved = kv.prefix, kv.tiers, roster.on_done
  kv.prefix, kv.tiers, roster.on_done = None, None, None
  try:
    yield
  finally:
    kv.prefix, kv.tiers, roster.on_done = saved
    for obj, name, value in kept:
      setattr(obj, name, value)


def warm_up(engine) -> tuple[int, float]:
  """Runs the warm-up requests (module docstring) to completion -> (step shapes compiled,
  seconds). Call it before the engine serves (nothing else may be submitted meanwhile)."""
  t0 = time.monotonic()
  before = len(engine.runner.compiled)
  with _uncached(engine):
    for count in [1] if engine.serve.batch_invariant else groups(engine.max_batch):
      n = prompt_tokens(engine.max_len, count)
      if not n:
        continue
      prompt = (np.arange(n) % (engine.cfg.vocab_size - 1) + 1).astype(np.int32)
      reqs = [engine.submit(prompt, SamplingParams(max_tokens=count + 2),
                            use_prefix_cache=False, timeout=None) for _ in range(count)]
      engine.run_until_done(reqs)
      failed = [r for r in reqs if r.error is not None]
      if failed:
        raise RuntimeError(f"the warm-up request failed: {failed[0].error}")
  engine.runner.compile_ckpt_steps()     # the prefix cache's first checkpoint save / load
  return len(engine.runner.compiled) - before, time.monotonic() - t0


__all__ = ["warm_up", "groups", "prompt_tokens"]
