"""Restore a training workdir's model for inference: config, tokenizer and the latest
checkpoint's parameters, optionally with the routed experts packed to MXFP4, in an Engine."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator

import jax

from k3_jax import train
from k3_jax.checkpoint.manager import CheckpointManager, saved_config
from k3_jax.config import EXPERT_FORMATS, ModelConfig, TrainConfig, UserError
from k3_jax.data import tokenizers
from k3_jax.serve.pack import pack_state
from k3_jax.serve.engine import Engine
from sharding.mesh import make_mesh


@dataclasses.dataclass
class Restored:
  cfg: ModelConfig
  engine: Engine
  tokenizer: tokenizers.Tokenizer
  step: int                          # the checkpoint's training step


def saved_train_config(workdir: str) -> TrainConfig | None:
  """The TrainConfig the train command wrote to <workdir>/train_config.json, if any."""
  path = os.path.join(workdir, "train_config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    saved = json.load(f)
  names = {f.name for f in dataclasses.fields(TrainConfig)}
  return TrainConfig(**{k: v for k, v in saved.items() if k in names})


def restore_for_inference(workdir: str, expert_format: str = "dense",
                          tokenizer: str | None = None) -> Restored:
  """The latest checkpoint of `workdir` on one device, ready to generate.

  expert_format "mxfp4" converts the routed experts to packed MXFP4 at load (the MoE then
  runs the same computation as the QAT forward); "dense" keeps the stored dtype. tokenizer
  defaults to the one the run trained with (train_config.json), else the byte tokenizer."""
  if expert_format not in EXPERT_FORMATS:
    raise UserError(f"expert_format={expert_format!r}: expected one of "
                    f"{', '.join(EXPERT_FORMATS)}")
  cfg = saved_config(workdir)
  if cfg is None:
    raise UserError(f"no checkpoints in {workdir}: train first "
                    f"(python main.py train --workdir={workdir})")
  saved_tc = saved_train_config(workdir)
  # The optimizer decides the shape of the saved state (its moments are restored too).
  tc = TrainConfig(optimizer=saved_tc.optimizer) if saved_tc else TrainConfig()
  ckpt = CheckpointManager(workdir, cfg)
  step = ckpt.latest_step()
  if step is None:
    raise UserError(f"{workdir} has a config but no completed checkpoint")
  steps = train.build_steps(cfg, tc, make_mesh(devices=jax.devices()[:1]))
  state, _ = ckpt.restore(steps.abstract_state, steps.state_shardings, step)
  graphdef, params, rest = steps.graphdef, state["params"], state["rest"]
  if expert_format == "mxfp4":
    graphdef, params, rest = pack_state(graphdef, params, rest)
  tok = tokenizers.get_tokenizer(tokenizer or (saved_tc.tokenizer if saved_tc else "byte"))
  return Restored(cfg, Engine(cfg, graphdef, params, rest), tok, step)


def stream_completion(restored: Restored, prompt: str, max_new_tokens: int,
                      temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                      frequency_penalty: float = 0.0,
                      presence_penalty: float = 0.0) -> Iterator[str]:
  """Text pieces of the completion of `prompt` as they are sampled (stops at EOS)."""
  tok = restored.tokenizer
  stream = tok.stream_decoder()
  stop = () if tok.eos_id is None else (tok.eos_id,)
  for tid in restored.engine.generate(tok.encode(prompt), max_new_tokens, temperature, top_p,
                                      seed=seed, stop_ids=stop,
                                      frequency_penalty=frequency_penalty,
                                      presence_penalty=presence_penalty):
    if tid in stop:
      break
    piece = stream.add(tid)
    if piece:
      yield piece
  tail = stream.flush()
  if tail:
    yield tail
