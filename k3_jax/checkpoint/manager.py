"""Orbax checkpoints of the train state plus the data iterator's state.

Layout: <workdir>/checkpoints/<step>/{state,data} and <workdir>/checkpoints/model_config.json.

- Saves are asynchronous (Orbax): `save` returns once the arrays are copied off the device
  and the write goes on in a background thread. Each step is written to a temporary
  directory and renamed when complete, and older steps beyond `keep` are deleted only after
  that, so a crash or kill mid-save never damages or removes the last good checkpoint; the
  unfinished temporary directory is discarded (synchronously) when the next training run
  opens the manager.
- Each completed step gets an integrity manifest (integrity.py: size and CRC-32 of every
  file), written once Orbax has committed it; a restore checks it before handing any file
  to Orbax, so a damaged step is refused without a read being started (a failed Orbax read
  leaves abandoned reads that print tracebacks).
- Restores try the newest step first; a step that cannot be read (a truncated, zeroed or
  missing file) or whose parameters are not finite is reported in one line and the previous
  one is used. Training moves such a step aside (renamed `<step>.damaged-<time>`; `<step>.newer-<time>`
  for steps after an explicit --step), never deleted) so
  its number can be written again; on a multi-host job every process waits at a barrier
  until process 0 has renamed them.
- `restore_params` reads only what inference needs (parameters and balancing biases), never
  the optimizer state.
- A workdir whose checkpoints were made for a different model config is refused, never
  overwritten (see also resume.check_resume, which runs before anything is written). The
  model config holds what identifies the model only; how a job runs it (kernels, capacity:
  k3_jax/execution.py) is not saved with it, so a checkpoint resumes or serves under any.
  An old model_config.json that still holds the former execution fields (config.MOVED_FIELDS)
  matches the same model, and `saved_execution` reads those fields.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from typing import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging

from k3_jax.checkpoint import integrity, streaming
from k3_jax.config import ModelConfig, UserError, from_dict, to_dict, without_execution_fields
from k3_jax.execution import moved_from
from sharding.arrays import all_finite


TMP_MARK = ".orbax-checkpoint-tmp"     # Orbax's suffix of a step directory being written


class CheckpointMismatch(UserError):
  """The workdir holds checkpoints of a different model configuration."""


class CheckpointUnusable(UserError):
  """No checkpoint (or not the requested one) in the workdir can be restored."""


def config_diff(a: dict, b: dict, prefix: str = "") -> list[str]:
  out = []
  for k in sorted(set(a) | set(b)):
    va, vb = a.get(k), b.get(k)
    if isinstance(va, dict) and isinstance(vb, dict):
      out += config_diff(va, vb, f"{prefix}{k}.")
    elif va != vb and not (isinstance(va, (list, tuple)) and list(va) == list(vb or [])):
      out.append(f"{prefix}{k}: saved {va!r}, requested {vb!r}")
  return out


def checkpoint_dir(workdir: str) -> str:
  return os.path.abspath(os.path.join(workdir, "checkpoints"))


def saved_config(workdir: str) -> ModelConfig | None:
  path = os.path.join(checkpoint_dir(workdir), "model_config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return from_dict(json.load(f))


def saved_execution(workdir: str) -> dict:
  """The execution settings an old model_config.json of the workdir held as model fields,
  by their ExecConfig names (execution.moved_from); {} for a new one, or none."""
  path = os.path.join(checkpoint_dir(workdir), "model_config.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return moved_from(json.load(f))


def step_dirs(workdir: str) -> list[int]:
  """Completed checkpoint steps on disk (directories named by an integer), ascending.
  Orbax's temporary directories (`<step>.orbax-checkpoint-tmp-*`) are not steps."""
  d = checkpoint_dir(workdir)
  if not os.path.isdir(d):
    return []
  return sorted(int(n) for n in os.listdir(d)
                if n.isdigit() and os.path.isdir(os.path.join(d, n)))


def _short(e: BaseException, limit: int = 160) -> str:
  text = " ".join(str(e).split()) or type(e).__name__
  text = f"{type(e).__name__}: {text}"
  return text if len(text) <= limit else text[:limit - 3] + "..."


_all_finite_jit = jax.jit(all_finite)


def _finite(tree) -> bool:
  """all_finite of a restored tree in one program (compiled once per tree structure):
  checked leaf by leaf it compiled two small programs per distinct leaf shape, in every
  process that restores a checkpoint (74 in the resume test)."""
  return bool(_all_finite_jit(tree))


class CheckpointManager:
  """read_only: open an existing checkpoint directory for restoring (generate, serving):
  nothing is created, written or cleaned up."""

  def __init__(self, workdir: str, cfg: ModelConfig, keep: int = 2, read_only: bool = False):
    self.directory = checkpoint_dir(workdir)
    self.workdir = workdir
    self.read_only = read_only
    self.keep = keep
    self._unsealed: list[int] = []      # saved by us, integrity manifest not yet written
    self._sealer: threading.Thread | None = None
    self._seal_error: BaseException | None = None
    cfg_path = os.path.join(self.directory, "model_config.json")
    wanted = json.loads(json.dumps(to_dict(cfg)))
    if os.path.exists(cfg_path):
      with open(cfg_path) as f:
        saved = json.load(f)
      diff = config_diff(without_execution_fields(saved), without_execution_fields(wanted))
      if diff and step_dirs(workdir):
        raise CheckpointMismatch(
            f"{self.directory} holds checkpoints of a different model config "
            f"({saved.get('name')!r}); refusing to overwrite them. Differences: "
            + "; ".join(diff[:8]) + ". Use another --workdir.")
      if diff and not read_only:         # a config with no checkpoint to protect: replaced
        self._write_config(cfg_path, wanted)
    elif read_only:
      raise FileNotFoundError(f"no checkpoints in {self.directory}")
    else:
      os.makedirs(self.directory, exist_ok=True)
      self._write_config(cfg_path, wanted)
    if not read_only:
      self.discard_unfinished()
    self._mgr = self._open()

  @staticmethod
  def _write_config(cfg_path: str, wanted: dict) -> None:
    if jax.process_index() == 0:   # multi-host: one writer (Orbax: every host saves shards)
      tmp = cfg_path + ".tmp"
      with open(tmp, "w") as f:
        json.dump(wanted, f, indent=1)
      os.replace(tmp, cfg_path)

  def _open(self):
    # lightweight_initialize: Orbax does not read every step's _CHECKPOINT_METADATA when
    # opening (we use neither its save times nor its metrics; steps are kept by number), so
    # a damaged one is first met by our integrity check, not logged by Orbax on the way.
    # Unfinished saves are discarded by discard_unfinished, synchronously: Orbax's own
    # cleanup_tmp_directories runs in a thread that nothing but the next save waits for, so
    # a process ending before that (a failed or interrupted start) printed its traceback.
    if not self.read_only:
      opts = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True,
                                          lightweight_initialize=True)
      return ocp.CheckpointManager(self.directory, options=opts, item_names=("state", "data"))
    opts = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                        lightweight_initialize=True)
    old = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)   # Orbax warns that read-only is read-only
    try:
      return ocp.CheckpointManager(self.directory, options=opts, item_names=("state", "data"))
    finally:
      absl_logging.set_verbosity(old)

  def discard_unfinished(self) -> None:
    """Removes the temporary directories of saves that never completed (a kill mid-save):
    `<step>.orbax-checkpoint-tmp-*`, which no restore reads. Process 0 removes, the others
    wait for it."""
    if jax.process_index() == 0:
      for n in os.listdir(self.directory):
        path = os.path.join(self.directory, n)
        if TMP_MARK in n and os.path.isdir(path):
          shutil.rmtree(path)
    sync_processes("k3_discard_unfinished")

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._mgr.all_steps())

  def step_path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state, data_state: dict | None) -> None:
    """Starts an asynchronous save of `step` (returns before the write completes). The
    previous save is finished first (Orbax would wait for it anyway) and sealed in a
    background thread, so the step never waits on hashing."""
    self._mgr.wait_until_finished()
    self._seal(background=True)
    self._mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state or {})))
    self._unsealed.append(step)

  def _seal(self, background: bool = False) -> None:
    """Writes the integrity manifest of each step this manager saved whose save has
    finished (call only after Orbax's wait_until_finished), in a thread if `background`
    (joined by the next _seal). A step Orbax did not commit (no final directory), or deleted
    meanwhile (max_to_keep), gets none."""
    if self._sealer is not None:
      self._sealer.join()
      self._sealer, error = None, self._seal_error
      self._seal_error = None
      if error is not None:
        raise error
    pending, self._unsealed = self._unsealed, []
    if jax.process_index() != 0 or not pending:   # multi-host: the primary writes
      return

    def work():
      try:
        for s in pending:
          path = self.step_path(s)
          if os.path.isdir(path) and not integrity.has_manifest(path):
            try:
              integrity.write_manifest(path)
            except FileNotFoundError:      # the step was deleted under us (max_to_keep)
              pass
      except BaseException as e:           # re-raised by the next _seal
        self._seal_error = e

    if background:
      self._sealer = threading.Thread(target=work, name="k3-seal", daemon=True)
      self._sealer.start()
    else:
      work()
      if self._seal_error is not None:
        error, self._seal_error = self._seal_error, None
        raise error

  def save_streamed(self, step: int, state, data_state: dict | None,
                    batch_bytes: int | None = None) -> None:
    """Saves (synchronously) a state whose leaves are streaming.LazyArray: each produced and
    written one row at a time. The files are those `save` writes (Orbax's PyTree format,
    numpy arrays under OCDBT), so every restore path reads them alike. batch_bytes: rows per
    tensorstore commit (streaming.BATCH_BYTES by default)."""
    registry = ocp.type_handlers.create_type_handler_registry(
        (streaming.LazyArray, streaming.LazyArrayHandler(batch_bytes or streaming.BATCH_BYTES)),
        (jax.Array, ocp.type_handlers.ArrayHandler()))   # (Orbax wants one for its metadata)
    opts = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=True,
                                        lightweight_initialize=True)
    mgr = ocp.CheckpointManager(self.directory, options=opts, item_handlers={
        "state": ocp.PyTreeCheckpointHandler(type_handler_registry=registry),
        "data": ocp.JsonCheckpointHandler()})
    try:
      mgr.save(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state or {})))
      mgr.wait_until_finished()
    finally:
      mgr.close()
    if jax.process_index() == 0:      # sealed like any finished save (see _seal)
      integrity.write_manifest(self.step_path(step))
    self._mgr.close()                 # see the new step
    self._mgr = self._open()

  # ----- restoring -----------------------------------------------------------------------

  @staticmethod
  def _target(abstract, shardings):
    return jax.tree.map(
        lambda sh, sub: jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), sub),
        shardings, abstract)

  def restore(self, abstract_state, shardings, step: int | None = None):
    """(state placed with `shardings`, data iterator state or None) of `step` (default
    latest), with no fallback (see restore_for_training)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    out = self._mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(self._target(abstract_state, shardings)),
        data=ocp.args.JsonRestore()))
    return out.state, (out.data or None)

  def _restore_subset(self, step: int, abstract: dict, shardings: dict) -> dict:
    """Only the entries of `abstract` (e.g. {"step", "params", "rest"}) from the saved state;
    nothing else (the optimizer state) is read."""
    target = self._target(abstract, shardings)
    out = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True)))
    return out.state

  def _first_good(self, load: Callable[[int], object], step: int | None,
                  log: Callable[[str], None], finite: Callable[[object], bool] | None = None):
    """(step, load(step)) of `step` or else the newest step that loads with finite
    parameters (finite(loaded); default: its "params" checked in memory); each unusable
    newer step is reported in one line."""
    steps = self.all_steps()
    if step is not None:
      if step not in steps:
        raise CheckpointUnusable(
            f"--step={step}: no such checkpoint in {self.directory} (available: "
            f"{', '.join(map(str, steps)) or 'none'})")
      candidates = [step]
    else:
      candidates = steps[::-1]
    if not candidates:
      return None
    problems = []
    for i, s in enumerate(candidates):
      # The integrity manifest first: a damaged step is refused before Orbax starts a read
      # (a failed Orbax restore leaves reads behind that print tracebacks).
      damage = integrity.check_manifest(self.step_path(s))
      if damage:
        problem = f"checkpoint step {s} in {self.directory} is damaged ({damage})"
      else:
        try:
          out = load(s)
        except Exception as e:         # any read error: an unverified step's damaged files
          problem = f"checkpoint step {s} in {self.directory} is unreadable ({_short(e)})"
        else:
          if finite is not None:
            ok = finite(out)
          else:
            ok = _finite(out[0]["params"] if isinstance(out, tuple) else out["params"])
          if ok:
            return s, out
          problem = f"checkpoint step {s} in {self.directory} holds non-finite parameters"
      problems.append((s, problem))
      if step is not None:
        raise CheckpointUnusable(problem)
      nxt = candidates[i + 1] if i + 1 < len(candidates) else None
      log(problem + (f"; using step {nxt} instead" if nxt is not None else
                     "; no older checkpoint to fall back to"))
    raise CheckpointUnusable(f"no usable checkpoint in {self.directory}: "
                             + "; ".join(p for _, p in problems))

  def restore_for_training(self, abstract_state, shardings, step: int | None = None,
                           log: Callable[[str], None] = print):
    """(state, data state) of `step`, or of the newest good step (falling back past damaged
    or non-finite ones, reported in one line each); None if there is no checkpoint. Newer
    unusable steps are moved aside (renamed, not deleted) so training can write them anew."""
    found = self._first_good(lambda s: self.restore(abstract_state, shardings, s), step, log)
    if found is None:
      return None
    good, out = found
    newer = [s for s in self.all_steps() if s > good]
    if newer and not self.read_only:
      self.set_aside(newer, "newer" if step is not None else "damaged", log)
    return out

  def restore_params(self, abstract_state, shardings, step: int | None = None,
                     log: Callable[[str], None] = print):
    """(step, params, rest) for inference: only parameters and balancing biases are read,
    from `step` or the newest good step (with the same fallback as training)."""
    keys = ("step", "params", "rest")
    sub_abs = {k: abstract_state[k] for k in keys}
    sub_sh = {k: shardings[k] for k in keys}
    found = self._first_good(lambda s: self._restore_subset(s, sub_abs, sub_sh), step, log)
    if found is None:
      raise FileNotFoundError(f"{self.workdir} has a config but no completed checkpoint")
    good, out = found
    return good, out["params"], out["rest"]

  def stored_params(self, step: int | None = None, log: Callable[[str], None] = print):
    """(step, streaming.StoredArrays of its state) to read the parameters and balancing
    biases row by row (export), never whole: `step` or the newest good one, with the same
    fallback as restore_params (the finite check streams, a row at a time)."""
    def load(s):                       # read errors here are reported like a restore's
      st = streaming.StoredArrays(os.path.join(self.step_path(s), "state"))
      return st, st.all_finite(("params",)) and st.all_finite(("rest",))

    found = self._first_good(load, step, log, finite=lambda out: out[1])
    if found is None:
      raise FileNotFoundError(f"{self.workdir} has a config but no completed checkpoint")
    return found[0], found[1][0]

  def set_aside(self, steps: list[int], why: str, log: Callable[[str], None]) -> None:
    """Renames these step directories to `<step>.<why>-<time>`: kept on disk, no longer
    restored, their numbers free to be written again. Process 0 renames; on a multi-host
    job every process waits for it at a barrier before reopening the directory, so none
    lists or writes a step that is being moved."""
    self.wait()
    self._mgr.close()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if jax.process_index() == 0:
      for s in steps:
        src = self.step_path(s)
        dst = f"{src}.{why}-{stamp}"
        os.replace(src, dst)
        log(f"moved checkpoint step {s} aside to {dst} (kept, not deleted)")
    sync_processes(f"k3_set_aside_{why}_{'_'.join(map(str, steps))}")
    self._mgr = self._open()

  def wait(self) -> None:
    """Waits for the save in flight and seals the steps it completed."""
    self._mgr.wait_until_finished()
    self._seal()

  def close(self) -> None:
    self.wait()
    self._mgr.close()


def sync_processes(name: str) -> None:
  """A barrier across the job's processes (no-op with one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)
