"""Orbax checkpoints of the train state plus the data iterator's state.

Layout: <workdir>/checkpoints/<step>/{state,data} and <workdir>/checkpoints/model_config.json.
Orbax writes each step to a temporary directory and renames it when complete, so a crash
mid-save never damages the last good checkpoint; `max_to_keep` older ones are retained.
A workdir whose checkpoints were made for a different model config is refused, never
overwritten; execution-only fields (config.EXECUTION_FIELDS: kernel backend, grouped matmul,
expert-parallel capacity) may differ, since they do not change the parameters.
"""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp

from k3_jax.config import ModelConfig, from_dict, to_dict, without_execution_fields


class CheckpointMismatch(ValueError):
  """The workdir holds checkpoints of a different model configuration."""


def _config_diff(a: dict, b: dict, prefix: str = "") -> list[str]:
  out = []
  for k in sorted(set(a) | set(b)):
    va, vb = a.get(k), b.get(k)
    if isinstance(va, dict) and isinstance(vb, dict):
      out += _config_diff(va, vb, f"{prefix}{k}.")
    elif va != vb and not (isinstance(va, (list, tuple)) and list(va) == list(vb or [])):
      out.append(f"{prefix}{k}: saved {va!r}, requested {vb!r}")
  return out


def saved_config(workdir: str) -> ModelConfig | None:
  path = os.path.join(workdir, "checkpoints", "model_config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return from_dict(json.load(f))


class CheckpointManager:
  def __init__(self, workdir: str, cfg: ModelConfig, keep: int = 2):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    os.makedirs(self.directory, exist_ok=True)
    cfg_path = os.path.join(self.directory, "model_config.json")
    wanted = json.loads(json.dumps(to_dict(cfg)))
    if os.path.exists(cfg_path):
      with open(cfg_path) as f:
        saved = json.load(f)
      diff = _config_diff(without_execution_fields(saved), without_execution_fields(wanted))
      if diff:
        raise CheckpointMismatch(
            f"{self.directory} holds checkpoints of a different model config "
            f"({saved.get('name')!r}); refusing to overwrite them. Differences: "
            + "; ".join(diff[:8]) + ". Use another --workdir.")
    elif jax.process_index() == 0:   # multi-host: one writer (Orbax: every host saves shards)
      tmp = cfg_path + ".tmp"
      with open(tmp, "w") as f:
        json.dump(wanted, f, indent=1)
      os.replace(tmp, cfg_path)
    self._mgr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_names=("state", "data"))

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def save(self, step: int, state, data_state: dict | None) -> None:
    self._mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state or {})))

  def restore(self, abstract_state, shardings, step: int | None = None):
    """(state placed with `shardings`, data iterator state or None) of `step` (default latest)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    target = jax.tree.map(
        lambda sh, sub: jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), sub),
        shardings, abstract_state)
    out = self._mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
    return out.state, (out.data or None)

  def restore_params(self, abstract_state, shardings, step: int | None = None) -> dict:
    """Only the model variables ('params', 'rest') of `step` (default latest), as a flat
    dict variable path -> array; the optimizer state stays on disk (Orbax partial restore),
    so an export holds the model once, not three times."""
    from flax import nnx
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    target: dict = {}
    for part in ("params", "rest"):
      shard = dict(nnx.to_flat_state(shardings[part]))
      for path, var in nnx.to_flat_state(abstract_state[part]):
        node = target.setdefault(part, {})
        for k in path:
          node = node.setdefault(str(k), {})
        sh = shard[path]
        sh = sh.get_value() if hasattr(sh, "get_value") else sh
        node["value"] = jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=sh)
    out = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True)))
    flat = {}
    for part in ("params", "rest"):
      for path, var in nnx.to_flat_state(abstract_state[part]):
        node = out.state[part]
        for k in path:
          node = node[str(k)]
        flat[tuple(path)] = node["value"]
    return flat

  def all_steps(self) -> list[int]:
    return sorted(self._mgr.all_steps())

  def wait(self) -> None:
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.close()
