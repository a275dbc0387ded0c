"""Restore a training workdir's model for inference: config, tokenizer and a good
checkpoint's parameters, optionally with the routed experts packed to MXFP4, in an Engine."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import jax

from k3_jax.checkpoint.inference import load_for_inference, trained_tokenizer
from k3_jax.config import EXPERT_FORMATS, ModelConfig, UserError
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


def restore_for_inference(workdir: str, expert_format: str = "dense",
                          tokenizer: str | None = None, step: int | None = None,
                          log: Callable[[str], None] = print) -> Restored:
  """A good checkpoint of `workdir` (the newest, or `step`) on one device, ready to generate.

  Only the parameters and balancing biases are read, never the optimizer state; a damaged or
  non-finite newer checkpoint is reported through `log` in one line and skipped
  (k3_jax.checkpoint.inference). expert_format "mxfp4" converts the routed experts to packed
  MXFP4 at load (the MoE then runs the same computation as the QAT forward); "dense" keeps
  the stored dtype. tokenizer defaults to the one the run trained with (train_config.json),
  else the byte tokenizer."""
  if expert_format not in EXPERT_FORMATS:
    raise UserError(f"expert_format={expert_format!r}: expected one of "
                    f"{', '.join(EXPERT_FORMATS)}")
  tok = tokenizers.get_tokenizer(trained_tokenizer(workdir, tokenizer))
  loaded = load_for_inference(workdir, make_mesh(devices=jax.devices()[:1]), step, log)
  graphdef, params, rest = loaded.graphdef, loaded.params, loaded.rest
  if expert_format == "mxfp4":
    graphdef, params, rest = pack_state(graphdef, params, rest)
  return Restored(loaded.cfg, Engine(loaded.cfg, graphdef, params, rest), tok, loaded.step)


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
