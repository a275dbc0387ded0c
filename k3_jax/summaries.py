"""TensorBoard event files of the training metrics: every scalar of a metrics.jsonl line
also goes to <workdir>/tensorboard, which `tensorboard --logdir <workdir>/tensorboard` reads.

Written with TensorBoard's own event-file writer (tensorboard.summary.writer, the protobuf
Event / Summary records; no TensorFlow needed). Tags are the metrics.jsonl keys under a
section, so TensorBoard groups them:

    train/loss, train/grad_norm, train/skipped_steps   eval/loss
    lr/adamw, lr/muon                                   speed/tokens_per_sec, speed/step_time
    moe/load_max_mean, moe/zero_load_experts, ...       qk_clip/max_logit, qk_clip/clipped_heads
    goodput/goodput, goodput/time_steps, ..., goodput/wall_time

A resumed run starts with a SessionLog START event at its first step: TensorBoard then drops
the points a previous run logged at or past that step (the same rule as `MetricsWriter.
resume_at` applies to metrics.jsonl), so a resumed curve is never drawn twice.
"""

from __future__ import annotations

import numbers
import os
import time

_SECTIONS = (("eval_", "eval/"), ("lr_", "lr/"), ("load_", "moe/"), ("zero_load_", "moe/"),
             ("time_", "goodput/"))
_TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm",
         "skipped_steps": "train/skipped_steps", "tokens_per_sec": "speed/tokens_per_sec",
         "step_time": "speed/step_time", "max_logit": "qk_clip/max_logit",
         "qk_clipped_heads": "qk_clip/clipped_heads", "goodput": "goodput/goodput",
         "wall_time": "goodput/wall_time", "eval_loss": "eval/loss"}


def tag_of(key: str) -> str:
  """The TensorBoard tag of a metrics.jsonl key."""
  if key in _TAGS:
    return _TAGS[key]
  for prefix, section in _SECTIONS:
    if key.startswith(prefix):
      return section + (key[len(prefix):] if section in ("eval/", "lr/") else key)
  return "other/" + key


def scalars(record: dict) -> dict[str, float]:
  """tag -> value of the numeric fields of one metrics record (not the step, not flags)."""
  out = {}
  for k, v in record.items():
    if k == "step" or isinstance(v, bool) or not isinstance(v, numbers.Real):
      continue
    out[tag_of(k)] = float(v)
  return out


class TensorBoardWriter:
  """Scalars of metrics records -> event files under `logdir` (created on the first write)."""

  def __init__(self, logdir: str, resume_step: int | None = None):
    self.logdir = logdir
    self._resume_step = resume_step
    self._writer = None

  def resume_at(self, step: int) -> None:
    """The run resumes after `step`: earlier runs' points past it are to be dropped."""
    self._resume_step = step

  def _open(self):
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    os.makedirs(self.logdir, exist_ok=True)
    self._writer = EventFileWriter(self.logdir)
    if self._resume_step is not None:
      # Points at or past resume_step + 1 from an earlier run are dropped by TensorBoard.
      self._writer.add_event(event_pb2.Event(
          wall_time=time.time(), step=self._resume_step + 1,
          session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
    return self._writer

  def write(self, record: dict) -> None:
    from tensorboard.compat.proto import event_pb2, summary_pb2
    values = scalars(record)
    if not values:
      return
    writer = self._writer or self._open()
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=t, simple_value=v)
                                         for t, v in values.items()])
    writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(record["step"]),
                                     summary=summary))
    writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """tag -> [(step, value)] as TensorBoard reads `logdir` (its EventAccumulator; orphaned
  points of a resumed run purged)."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
  acc.Reload()
  return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


__all__ = ["TensorBoardWriter", "read_scalars", "scalars", "tag_of"]
