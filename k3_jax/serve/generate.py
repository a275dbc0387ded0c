"""A simple front end of the engine: one prompt's sampled tokens as they come
(Engine.generate), stepping the engine itself (no server, no thread), and the `generate`
command's prompts and text over a model the loader restored (loader.Restored)."""

from __future__ import annotations

from typing import Iterator, Sequence

from k3_jax.config import UserError
from k3_jax.data import images as im
from k3_jax.data import tokenizers
from k3_jax.serve.requests import RequestError, SamplingParams


def generate(engine, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, stop_ids=(), frequency_penalty: float = 0.0,
             presence_penalty: float = 0.0, images: dict | None = None) -> Iterator[int]:
  """Yields up to max_new_tokens sampled token ids for one prompt (a stop id is yielded,
  then generation ends). The penalties lower the logits of tokens already generated
  (sampling.penalize; the prompt is not counted); unlike the server, which keeps the
  OpenAI range [-2, 2], any finite value is accepted here. images: packed images for the
  prompt's placeholders (see Engine.submit)."""
  try:
    req = engine.submit(prompt_ids, SamplingParams(
        max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
        stop_ids=tuple(stop_ids), frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty), openai_ranges=False, images=images)
  except RequestError as e:
    raise UserError(str(e)) from None
  sent = 0
  while True:
    while sent < len(req.output_ids):
      yield req.output_ids[sent]
      sent += 1
    if req.state == "done":
      if req.error:
        raise RuntimeError(f"the request failed: {req.error}")
      return
    engine.step()


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


def stop_ids(restored, token_ids_given: bool = False) -> tuple[int, ...]:
  """The id that ends a completion: the model config's eos_id for prompts given as token ids
  (the model's own vocabulary) when it has one, else the tokenizer's EOS."""
  if token_ids_given and restored.cfg.eos_id >= 0:
    return (restored.cfg.eos_id,)
  return () if restored.tokenizer.eos_id is None else (restored.tokenizer.eos_id,)


def generate_ids(restored, ids: list[int], max_new_tokens: int,
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


def prompt_ids(restored, prompt: str, image_paths: Sequence[str] = ()
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


def stream_completion(restored, prompt: str, max_new_tokens: int,
                      temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                      frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                      image_paths: Sequence[str] = ()) -> Iterator[str]:
  """Text pieces of the completion of `prompt` (after the images of `image_paths`, see
  prompt_ids) as they are sampled (stops at EOS). Bad input raises here, before any text."""
  ids, images = prompt_ids(restored, prompt, image_paths)
  return _pieces(restored, generate_ids(restored, ids, max_new_tokens, temperature, top_p, seed,
                                        frequency_penalty, presence_penalty, images=images))


def _pieces(restored, ids: Iterator[int]) -> Iterator[str]:
  stream = restored.tokenizer.stream_decoder()
  for tid in ids:
    piece = stream.add(tid)
    if piece:
      yield piece
  tail = stream.flush()
  if tail:
    yield tail


__all__ = ["generate", "parse_token_ids", "stop_ids", "generate_ids", "decode_or_none",
           "prompt_ids", "stream_completion"]
