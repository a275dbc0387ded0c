"""A single-request generation engine over the prefill / decode path.

Prefill runs once over the prompt (chunked KDA, latent MLA cache), then one jit-compiled
decode step per token; tokens are yielded as they are produced so callers can stream.
"""

from __future__ import annotations

from typing import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from k3_jax.config import ModelConfig
from k3_jax.model import check_tokens, decode_step, prefill
from k3_jax.serve.sampling import sample


class Engine:
  def __init__(self, cfg: ModelConfig, graphdef, params, rest):
    self.cfg = cfg
    self.graphdef, self.params, self.rest = graphdef, params, rest

    def _prefill(params, rest, tokens, max_len, images):
      return prefill(nnx.merge(graphdef, params, rest), tokens, max_len, images)

    def _decode(params, rest, cache, token, key, temperature, top_p):
      logits, cache = decode_step(nnx.merge(graphdef, params, rest), cache, token)
      return sample(key, logits, temperature, top_p), cache

    self._prefill = jax.jit(_prefill, static_argnums=(3,))
    self._decode = jax.jit(_decode, donate_argnums=(2,))

  def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, stop_ids=(),
               images: dict | None = None) -> Iterator[int]:
    """Yields up to max_new_tokens sampled token ids for one prompt.

    images: packed images (k3_jax/data/images.pack_images) whose features replace the
    prompt's image placeholders; their count must match (checked here, before any work)."""
    prompt = check_tokens(prompt_ids, self.cfg).reshape(1, -1)
    if images is not None:
      if self.cfg.vision is None:
        raise ValueError(f"{self.cfg.name} has no vision tower: it cannot take images")
      from k3_jax.data.images import check_placeholders
      check_placeholders(prompt, int(images["merge_idx"].shape[0]), self.cfg.vision)
    if prompt.shape[1] == 0:
      raise ValueError("the prompt is empty: give at least one token")
    total = prompt.shape[1] + max_new_tokens
    if total > self.cfg.max_seq_len:
      raise ValueError(f"prompt ({prompt.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) "
                       f"exceeds max_seq_len={self.cfg.max_seq_len}")
    if not 0.0 < top_p <= 1.0:
      raise ValueError(f"top_p={top_p} must lie in (0, 1]")
    if temperature < 0:
      raise ValueError(f"temperature={temperature} must be >= 0")
    logits, cache = self._prefill(self.params, self.rest, jnp.asarray(prompt, jnp.int32), total,
                                  images)
    key = jax.random.key(seed)
    key, sub = jax.random.split(key)
    token = sample(sub, logits[:, -1], temperature, top_p)
    for i in range(max_new_tokens):
      tid = int(token[0])
      yield tid
      if tid in stop_ids or i == max_new_tokens - 1:
        return
      key, sub = jax.random.split(key)
      token, cache = self._decode(self.params, self.rest, cache, token, sub,
                                  jnp.float32(temperature), jnp.float32(top_p))


__all__ = ["Engine"]
