"""Restore a training workdir's model for inference: config, tokenizer and a good
checkpoint's parameters, optionally with the routed experts packed to MXFP4, in an Engine."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Sequence

import jax

from k3_jax.checkpoint.inference import load_for_inference, trained_tokenizer
from k3_jax.config import EXPERT_FORMATS, SINGLE_STREAM, ModelConfig, UserError
from k3_jax.data import images as im
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
  return Restored(loaded.cfg, Engine(loaded.cfg, graphdef, params, rest, SINGLE_STREAM), tok,
                  loaded.step)


def restore_from_hf(hf_dir: str, expert_format: str = "dense",
                    tokenizer: str | None = None) -> Restored:
  """A Hugging Face directory's model (config.json + safetensors) on one device, read slice by
  slice straight into place (k3_jax.checkpoint.sharded_load), ready to generate; the
  directory's own tokenizer (tiktoken.model or tokenizer.json), else byte, unless
  `tokenizer` names another."""
  from flax import nnx
  from k3_jax.checkpoint.sharded_load import load_model_sharded
  if expert_format not in EXPERT_FORMATS:
    raise UserError(f"expert_format={expert_format!r}: expected one of "
                    f"{', '.join(EXPERT_FORMATS)}")
  cfg, model = load_model_sharded(hf_dir, make_mesh(devices=jax.devices()[:1]))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if expert_format == "mxfp4":
    graphdef, params, rest = pack_state(graphdef, params, rest)
  from k3_jax.serve.loader import hf_tokenizer_spec, load_checked_tokenizer
  tok = load_checked_tokenizer(tokenizer or hf_tokenizer_spec(hf_dir), cfg.vocab_size,
                               check_byte=False)
  return Restored(cfg, Engine(cfg, graphdef, params, rest, SINGLE_STREAM), tok, 0)


def parse_token_ids(text: str) -> list[int]:
  """"1,2,3" -> [1, 2, 3]; anything else is a UserError naming the text."""
  try:
    ids = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise UserError(f"--prompt_ids={text!r}: expected comma-separated integers, "
                    f"e.g. 1,2,3") from None
  if not ids:
    raise UserError(f"--prompt_ids={text!r}: no token ids")
  return ids


def stop_ids(restored: Restored, token_ids_given: bool = False) -> tuple[int, ...]:
  """The id that ends a completion: the model config's eos_id for prompts given as token ids
  (the model's own vocabulary) when it has one, else the tokenizer's EOS."""
  if token_ids_given and restored.cfg.eos_id >= 0:
    return (restored.cfg.eos_id,)
  return () if restored.tokenizer.eos_id is None else (restored.tokenizer.eos_id,)


def generate_ids(restored: Restored, ids: list[int], max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 token_ids_given: bool = False, images: dict | None = None) -> Iterator[int]:
  """Token ids continuing `ids` as they are sampled (stops before an EOS id, see stop_ids).
  images: packed images whose features take the placeholders of `ids` (see prompt_ids)."""
  stop = stop_ids(restored, token_ids_given)
  for tid in restored.engine.generate(ids, max_new_tokens, temperature, top_p, seed=seed,
                                      stop_ids=stop, frequency_penalty=frequency_penalty,
                                      presence_penalty=presence_penalty, images=images):
    if tid in stop:
      break
    yield tid


def decode_or_none(tok: tokenizers.Tokenizer, ids: list[int]) -> str | None:
  """The text of `ids`, or None when they fall outside the tokenizer's vocabulary (a model
  whose vocabulary the tokenizer does not cover)."""
  if any(not 0 <= i < tok.vocab_size for i in ids):
    return None
  return tok.decode(ids)


def prompt_ids(restored: Restored, prompt: str, image_paths: Sequence[str] = ()
               ) -> tuple[list[int], dict | None]:
  """(ids, packed images or None) of `prompt` text, after the images (each as its media tokens
  and placeholders) when image files are given; a bad image or a model without a vision tower
  is a UserError."""
  if not image_paths:
    return restored.tokenizer.encode(prompt), None
  if restored.cfg.vision is None:
    raise UserError(f"model {restored.cfg.name!r} has no vision tower (trained without images); "
                    "--image needs a model trained with one, e.g. --dataset=shapes")
  return im.prompt_with_images("", image_paths, prompt, restored.cfg.vision,
                               restored.tokenizer.encode)


def stream_completion(restored: Restored, prompt: str, max_new_tokens: int,
                      temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                      frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                      image_paths: Sequence[str] = ()) -> Iterator[str]:
  """Text pieces of the completion of `prompt` (after the images of `image_paths`, see
  prompt_ids) as they are sampled (stops at EOS). Bad input raises here, before any text."""
  ids, images = prompt_ids(restored, prompt, image_paths)
  return _pieces(restored, generate_ids(restored, ids, max_new_tokens, temperature, top_p, seed,
                                        frequency_penalty, presence_penalty, images=images))


def _pieces(restored: Restored, ids: Iterator[int]) -> Iterator[str]:
  stream = restored.tokenizer.stream_decoder()
  for tid in ids:
    piece = stream.add(tid)
    if piece:
      yield piece
  tail = stream.flush()
  if tail:
    yield tail
