"""Timing shared by the benchmarks: warm-up (compile), then the median of timed runs."""

from __future__ import annotations

import statistics
import time

import jax


def time_fn(fn, args, runs: int, slow_warmup_s: float | None = None) -> float:
  """Median seconds of `runs` calls of fn(*args) after one warm-up call (which compiles).
  With slow_warmup_s, a warm-up slower than that is followed by a single timed run."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  if slow_warmup_s is not None and time.perf_counter() - t0 > slow_warmup_s:
    runs = 1
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)
