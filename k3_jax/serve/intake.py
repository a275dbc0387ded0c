"""A request's checks before it is queued, and its host work when it is admitted.

The checks: the prompt's tokens, its images against their placeholders, and whether
prompt + max_tokens fits the context and the page pool (each failure a RequestError naming
the problem, which the server answers 400)."""

from __future__ import annotations

import math

import numpy as np

from k3_jax.config import ModelConfig
from k3_jax.data import images as im
from k3_jax.model import check_tokens
from k3_jax.serve.kv_pages import PAGE
from k3_jax.serve.prefix_cache import block_hashes, image_salts
from k3_jax.serve.requests import RequestError, SamplingParams


def check_images(cfg: ModelConfig, prompt: np.ndarray, images: dict | None) -> None:
  v = cfg.vision
  if images is None:
    if v is not None and np.any(prompt == v.image_token_id):
      raise RequestError(f"the prompt holds image placeholder tokens (id {v.image_token_id}) "
                         "but no images: send images as image content parts")
    return
  if v is None:
    raise RequestError(f"model {cfg.name!r} has no vision tower: it cannot take images")
  try:
    im.check_placeholders(prompt, int(images["merge_idx"].shape[0]), v)
  except ValueError as e:
    raise RequestError(str(e)) from None


def check_request(engine, prompt_ids, params: SamplingParams, openai_ranges: bool = True,
                  images: dict | None = None) -> np.ndarray:
  """The prompt as int32 [T] when `engine` can serve it with `params`; else RequestError."""
  cfg = engine.cfg
  params.validate(openai_ranges, cfg.vocab_size)
  if np.size(prompt_ids) == 0:
    raise RequestError("the prompt is empty: give at least one token")
  try:
    prompt = check_tokens(prompt_ids, cfg).reshape(-1).astype(np.int32)
  except ValueError as e:
    raise RequestError(str(e)) from None
  check_images(cfg, prompt, images)
  total = prompt.size + params.max_tokens
  if total > engine.max_len:
    raise RequestError(
        f"prompt ({prompt.size} tokens) + max_tokens ({params.max_tokens}) exceeds the "
        f"context of {engine.max_len} tokens")
  if not engine.kv.ever_fits(total):
    raise RequestError(
        f"prompt ({prompt.size} tokens) + max_tokens ({params.max_tokens}) needs "
        f"{math.ceil(total / PAGE)} pages of {PAGE} tokens; the KV cache holds "
        f"{engine.num_pages - 1} (raise --kv_cache_bytes or lower max_tokens)")
  if params.stop and engine.tokenizer is None:
    raise RequestError("stop strings need a tokenizer; this engine has none")
  return prompt


def prepare(r, feed: np.ndarray, tokenizer, prefix, match_tokens: int, cfg: ModelConfig) -> None:
  """r's host work at admission: its stream decoder, its blocks' prefix-cache keys (the
  blocks holding image placeholders keyed on the images' content too)."""
  if r.decoder is None and tokenizer is not None:
    r.decoder = tokenizer.stream_decoder()
  if prefix is not None:
    salts = None if r.images is None else image_salts(feed, r.images,
                                                      cfg.vision.image_token_id, match_tokens)
    r.hashes = block_hashes(feed, block=match_tokens, salts=salts)


__all__ = ["check_request", "check_images", "prepare"]
