"""Resume safety: compare a requested training run with what its workdir already holds,
before anything is written.

`check_resume` reads <workdir>/checkpoints/model_config.json, <workdir>/train_config.json
and the checkpoint step directories, and raises CheckpointMismatch naming the first fields
that differ in a way a resume cannot honour: the model config (the checkpoint's shapes),
the optimizer (the saved optimizer state's structure), the tokenizer (the token ids the
model learned). Learning rate, steps, batch size and the other schedule settings may
change between runs. It writes nothing, so a refused run leaves the workdir as it was.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax

from k3_jax.checkpoint.manager import (CheckpointMismatch, checkpoint_dir, config_diff,
                                       step_dirs)
from k3_jax.config import (ModelConfig, TrainConfig, UserError, to_dict,
                           without_execution_fields)

# Train-config fields a resume must keep: they fix the saved state's structure or meaning.
RESUME_FIXED = ("optimizer", "tokenizer")


class NothingToTrain(UserError):
  """The workdir is already past the requested number of steps."""


def save_train_config(workdir: str, tc: TrainConfig) -> None:
  """<workdir>/train_config.json: the run's TrainConfig (generate reads its optimizer, which
  shapes the saved state, and its tokenizer). Process 0 writes it, atomically."""
  if jax.process_index() != 0:
    return
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "train_config.json")
  with open(path + ".tmp", "w") as f:
    json.dump(dataclasses.asdict(tc), f, indent=1)
  os.replace(path + ".tmp", path)


def saved_train_config(workdir: str) -> dict | None:
  path = os.path.join(workdir, "train_config.json")
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except ValueError as e:
    raise CheckpointMismatch(f"{path} is not valid JSON ({e}); fix or remove it") from None


def _norm(v):
  """Paths (a tokenizer file) compare by the file they name."""
  if isinstance(v, str) and v not in ("byte", "muon", "adamw") and os.path.exists(v):
    return os.path.realpath(v)
  return v


def check_resume(workdir: str, cfg: ModelConfig, tc: TrainConfig) -> int | None:
  """The newest checkpoint step the run would resume from (None: a fresh start).

  Raises CheckpointMismatch (one message naming the differing fields) if the workdir's
  checkpoints were made by a different model config, optimizer or tokenizer, and
  NothingToTrain if they are already past tc.steps. Reads only; writes nothing.
  """
  steps = step_dirs(workdir)
  if not steps:
    return None                     # nothing to protect: a config left by a failed start
  where = checkpoint_dir(workdir)
  cfg_path = os.path.join(where, "model_config.json")
  if os.path.exists(cfg_path):
    with open(cfg_path) as f:
      saved = json.load(f)
    diff = config_diff(without_execution_fields(saved),
                       without_execution_fields(json.loads(json.dumps(to_dict(cfg)))))
    if diff:
      raise CheckpointMismatch(
          f"{where} holds checkpoints of a different model config ({saved.get('name')!r}); "
          f"refusing to overwrite them. Differences: " + "; ".join(diff[:8])
          + ". Use another --workdir.")
  saved_tc = saved_train_config(workdir)
  if saved_tc is not None:
    wanted = dataclasses.asdict(tc)
    diff = [f"{k}: saved {saved_tc[k]!r}, requested {wanted[k]!r}"
            for k in RESUME_FIXED if k in saved_tc and _norm(saved_tc[k]) != _norm(wanted[k])]
    if diff:
      raise CheckpointMismatch(
          f"{workdir} holds checkpoints trained with a different " +
          " and ".join(d.split(":")[0] for d in diff) + " (" + "; ".join(diff) +
          "); a resume must keep it. Pass the saved value or use another --workdir.")
  latest = steps[-1]
  if latest > tc.steps:
    raise NothingToTrain(
        f"{workdir} already holds step {latest}, past --steps={tc.steps}; pass --steps "
        f"greater than {latest} to train further (or use another --workdir)")
  return latest
