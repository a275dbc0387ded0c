"""Goodput: where the wall-clock time of a training run went.

`Goodput` splits the run into disjoint spans of named kinds (init, data, step, eval,
checkpoint); the time JAX spends compiling inside a span (tracing, lowering, XLA compile:
jax.monitoring's /jax/core/compile/* durations, nested ones counted once) is moved from the
span's kind to "compile". goodput = time in steps / wall time, so 1.0 means every second
went into optimizer steps. The parts never sum to more than the wall time: spans do not
overlap, and a span's compile share is at most its length.
"""

from __future__ import annotations

import contextlib
import threading
import time

import jax

KINDS = ("compile", "init", "data", "step", "eval", "checkpoint")
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class CompileClock:
  """Seconds spent compiling in this process: the union of the intervals of JAX's compile
  events. An event is reported when it ends; one that encloses earlier ones (a jit traced
  inside another's trace) replaces them, so nested time is counted once."""

  def __init__(self):
    self._lock = threading.Lock()
    self._spans: list[tuple[float, float]] = []     # (start, end), sorted by end
    self._done = 0.0                                # seconds in spans no longer tracked

  def __call__(self, event: str, duration: float, **_) -> None:
    if event not in COMPILE_EVENTS:
      return
    end = time.perf_counter()
    start = end - duration
    with self._lock:
      while self._spans and self._spans[-1][0] >= start:     # nested in the new one
        self._spans.pop()
      if self._spans and self._spans[-1][1] > start:          # partial overlap: trim
        start = self._spans[-1][1]
      self._spans.append((start, max(start, end)))
      if len(self._spans) > 64:                               # older ones cannot nest now
        s, e = self._spans.pop(0)
        self._done += e - s

  def seconds(self) -> float:
    with self._lock:
      return self._done + sum(e - s for s, e in self._spans)


_clock: CompileClock | None = None


def compile_seconds() -> float:
  """Seconds JAX has spent compiling since the first call of this function."""
  global _clock
  if _clock is None:
    _clock = CompileClock()
    jax.monitoring.register_event_duration_secs_listener(_clock)
  return _clock.seconds()


def _check_kind(kind: str) -> None:
  if kind not in KINDS or kind == "compile":
    raise ValueError(f"span kind {kind!r}: one of {', '.join(KINDS[1:])}")


class Goodput:
  """Time accounting of one run (one process), from its creation."""

  def __init__(self):
    compile_seconds()                     # listening from here on
    self._t0 = time.perf_counter()
    self.seconds = {k: 0.0 for k in KINDS}

  def mark(self) -> tuple[float, float]:
    """The start of a span: (wall clock, compile clock) now; see `charge`."""
    return time.perf_counter(), compile_seconds()

  def charge(self, kind: str, mark: tuple[float, float]) -> None:
    """Counts the time since `mark` as `kind`, less what was spent compiling meanwhile."""
    _check_kind(kind)
    elapsed = time.perf_counter() - mark[0]
    comp = min(max(compile_seconds() - mark[1], 0.0), elapsed)
    self.seconds["compile"] += comp
    self.seconds[kind] += elapsed - comp

  @contextlib.contextmanager
  def span(self, kind: str):
    """Times the block as `kind` (mark, then charge)."""
    _check_kind(kind)
    mark = self.mark()
    try:
      yield
    finally:
      self.charge(kind, mark)

  def wall(self) -> float:
    return time.perf_counter() - self._t0

  def fields(self) -> dict:
    """The metrics.jsonl fields: cumulative seconds per kind (time_compile, time_data,
    time_steps, time_checkpoint, time_eval, time_init), wall_time, and goodput."""
    wall = self.wall()
    out = {f"time_{'steps' if k == 'step' else k}": round(v, 4)
           for k, v in self.seconds.items()}
    out["wall_time"] = round(wall, 4)
    out["goodput"] = round(self.seconds["step"] / wall, 4) if wall > 0 else 0.0
    return out

  def summary(self) -> str:
    f = self.fields()
    other = max(f["wall_time"] - sum(v for k, v in f.items() if k.startswith("time_")), 0.0)
    parts = ", ".join(f"{k[5:]} {v:.1f}s" for k, v in f.items() if k.startswith("time_"))
    return (f"goodput {100 * f['goodput']:.1f}% of {f['wall_time']:.1f}s wall: {parts}, "
            f"other {other:.1f}s")


__all__ = ["Goodput", "CompileClock", "compile_seconds", "KINDS"]
