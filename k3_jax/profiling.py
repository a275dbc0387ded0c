"""A jax.profiler trace of a window of training steps (`train --profile_steps=A:B`).

The trace covers steps A..B (1-based, as metrics.jsonl numbers them, both included; each
step waited for, so its device work is inside the window) and is written under
<workdir>/profile/: plugins/profile/<run>/<host>.xplane.pb for TensorBoard's profile plugin
(`tensorboard --logdir=<workdir>/profile`) and perfetto_trace.json.gz for
https://ui.perfetto.dev.
"""

from __future__ import annotations

import glob
import os
from typing import Callable

import jax

from k3_jax.config import UserError


def parse_steps(spec: str | None) -> tuple[int, int] | None:
  """"A:B" -> (A, B) with 1 <= A <= B; "" or None -> None (no profiling)."""
  if not spec:
    return None
  parts = spec.split(":")
  try:
    a, b = (int(p) for p in parts)
  except ValueError:
    raise UserError(f"--profile_steps={spec!r}: expected FIRST:LAST step numbers, "
                    "e.g. 3:5") from None
  if not 1 <= a <= b:
    raise UserError(f"--profile_steps={spec!r}: need 1 <= FIRST <= LAST")
  return a, b


class StepTrace:
  """Starts the trace before step `first` and stops it after step `last` (or when the run
  ends inside the window). Only the steps this run takes are traced: a resumed run past
  `first` starts at its first step within the window."""

  def __init__(self, window: tuple[int, int] | None, directory: str,
               log: Callable[[str], None] = print):
    self.window, self.directory, self.log = window, directory, log
    self.active = False
    self.files: list[str] = []

  def before(self, step: int) -> None:
    """Call before taking step `step` (1-based)."""
    if self.window and not self.active and self.window[0] <= step <= self.window[1]:
      os.makedirs(self.directory, exist_ok=True)
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
      self.active, self._first = True, step

  def after(self, step: int) -> None:
    """Call once step `step` is finished (its results waited for)."""
    if self.active and step >= self.window[1]:
      self.close(step)

  def close(self, step: int | None = None) -> None:
    if not self.active:
      return
    jax.profiler.stop_trace()
    self.active = False
    self.files = sorted(p for p in glob.glob(os.path.join(self.directory, "**", "*"),
                                              recursive=True)
                        if os.path.isfile(p) and (p.endswith(".xplane.pb")
                                                  or p.endswith("perfetto_trace.json.gz")))
    last = f"-{step}" if step is not None else "-"
    self.log(f"profile of steps {self._first}{last} written to {self.directory} "
             f"(tensorboard --logdir={self.directory}, or open perfetto_trace.json.gz in "
             f"ui.perfetto.dev): {len(self.files)} trace files")


__all__ = ["parse_steps", "StepTrace"]
