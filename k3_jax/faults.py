"""Fault handling for the training loop: stop requests from signals, the bad-step streak,
JSON-safe metrics, and the test hooks that make fault tests deterministic.

- `StopRequest`: while active, SIGTERM / SIGINT only set a flag; the loop finishes the step
  in flight, checkpoints it, waits for the save and returns. The train job installs it first
  thing, so a signal during setup (restoring, compiling) is deferred to the first step
  boundary: that step is trained and saved, then the job exits 0 - a workdir is never left
  half-made and no traceback is printed. A second SIGINT aborts at once
  (exit 130, nothing more is written; an unfinished Orbax save stays a temporary directory
  that no restore reads).
- `BadSteps`: counts steps whose loss, gradient norm or updated parameters were not finite
  (the jit step skipped their update); `Diverged` when too many come in a row.
- `json_record`: metrics with non-finite values as null plus a "nonfinite" list naming them.

Imports nothing from the project (sits beside config.py in the dependency order).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from typing import Callable

import numpy as np


class Diverged(RuntimeError):
  """Training stopped after too many consecutive non-finite steps."""


class StopRequest:
  """Context manager: SIGTERM/SIGINT request a clean stop instead of killing the process.

  `requested` is the signal's name ("SIGTERM", "SIGINT") once one arrived, else None.
  Outside the main thread (where handlers cannot be installed) it is inert.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, log: Callable[[str], None] = print):
    self.log = log
    self.requested: str | None = None
    self.count = 0                  # signals received
    self._old: dict = {}

  def __enter__(self) -> "StopRequest":
    if threading.current_thread() is threading.main_thread():
      for s in self.SIGNALS:
        self._old[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, h in self._old.items():
      signal.signal(s, h)
    self._old = {}

  def _handle(self, signum, frame) -> None:
    name = signal.Signals(signum).name
    self.count += 1
    if self.requested is None:
      self.requested = name
      self.log(f"{name} received: finishing the step in flight (or, before training "
               f"starts, the first step), then saving a checkpoint (press Ctrl-C again to "
               f"abort at once without saving)")
      return
    if signum == signal.SIGINT:
      # os._exit: no interpreter teardown, so no traceback and no half-started Orbax work
      # from atexit hooks; an unfinished save stays a *.orbax-checkpoint-tmp-* directory,
      # which restores ignore.
      sys.stdout.flush()
      sys.stderr.write(f"{name} again: aborted without saving\n")
      sys.stderr.flush()
      os._exit(130)


class BadSteps:
  """The streak of skipped (non-finite) steps and the total skipped."""

  def __init__(self, max_in_a_row: int):
    if max_in_a_row < 1:
      raise ValueError(f"max_bad_steps={max_in_a_row}: must be at least 1")
    self.max_in_a_row = max_in_a_row
    self.in_a_row = 0
    self.total = 0
    self.first_bad: int | None = None

  def update(self, step: int, finite: bool) -> None:
    """Records `step`; raises Diverged when the streak reaches max_in_a_row."""
    if finite:
      self.in_a_row, self.first_bad = 0, None
      return
    self.in_a_row += 1
    self.total += 1
    if self.first_bad is None:
      self.first_bad = step

  @property
  def exhausted(self) -> bool:
    return self.in_a_row >= self.max_in_a_row


def json_record(record: dict) -> dict:
  """A metrics record safe for strict JSON: numpy scalars -> Python, NaN/inf -> None, and
  the names of those fields in record["nonfinite"]."""
  out, bad = {}, []
  for k, v in record.items():
    if isinstance(v, np.generic) or (hasattr(v, "shape") and getattr(v, "shape", None) == ()):
      v = np.asarray(v).item()
    if isinstance(v, float) and not math.isfinite(v):
      bad.append(k)
      v = None
    out[k] = v
  if bad:
    out["nonfinite"] = bad
  return out


# ----- test hooks (environment variables; inert unless set) ------------------------------

HOLD_ENV = "K3_TEST_HOLD_AFTER_STEP"       # after step N: print a line, wait for a signal
HOLD_SIGNALS_ENV = "K3_TEST_HOLD_SIGNALS"  # ... for this many signals (default 1)
KILL_ENV = "K3_TEST_SIGKILL_IN_SAVE"      # right after starting the save of step N: kill -9


def _env_step(name: str) -> int | None:
  raw = os.environ.get(name)
  return int(raw) if raw else None


def hold_for_signal(step: int, stop: StopRequest, log: Callable[[str], None]) -> None:
  """Test hook: after step `step` == $K3_TEST_HOLD_AFTER_STEP, announce it and wait (up to
  5 minutes) for $K3_TEST_HOLD_SIGNALS signals (default 1), so a test can send real signals
  at a known step."""
  if _env_step(HOLD_ENV) != step:
    return
  wanted = _env_step(HOLD_SIGNALS_ENV) or 1
  log(f"test hook: holding after step {step}")
  sys.stdout.flush()
  deadline = time.time() + 300
  while stop.count < wanted and time.time() < deadline:
    time.sleep(0.02)


def kill_in_save(step: int) -> None:
  """Test hook: SIGKILL this process right after the asynchronous save of step
  $K3_TEST_SIGKILL_IN_SAVE was started (the save is still in flight)."""
  if _env_step(KILL_ENV) == step:
    os.kill(os.getpid(), signal.SIGKILL)
