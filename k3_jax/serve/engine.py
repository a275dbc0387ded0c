"""A single-request generation engine over the prefill / decode path.

Prefill runs once over the prompt (chunked KDA, latent MLA cache), then one jit-compiled
decode step per token; tokens are yielded as they are produced so callers can stream.
"""

from __future__ import annotations

from typing import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from k3_jax.config import ModelConfig, UserError
from k3_jax.model import check_tokens, decode_step, prefill
from k3_jax.serve.sampling import penalize, sample


class Engine:
  def __init__(self, cfg: ModelConfig, graphdef, params, rest):
    self.cfg = cfg
    self.graphdef, self.params, self.rest = graphdef, params, rest

    def _prefill(params, rest, tokens, max_len):
      return prefill(nnx.merge(graphdef, params, rest), tokens, max_len)

    def _decode(params, rest, cache, token, key, temperature, top_p, counts, freq, presence):
      logits, cache = decode_step(nnx.merge(graphdef, params, rest), cache, token)
      counts = counts.at[jnp.arange(token.shape[0]), token].add(1)   # [B, V] tokens so far
      logits = penalize(logits, counts, freq, presence)
      return sample(key, logits, temperature, top_p), cache, counts

    self._prefill = jax.jit(_prefill, static_argnums=(3,))
    self._decode = jax.jit(_decode, donate_argnums=(2,))

  def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, stop_ids=(), frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0) -> Iterator[int]:
    """Yields up to max_new_tokens sampled token ids for one prompt. The penalties lower the
    logits of tokens already generated (sampling.penalize; the prompt is not counted)."""
    prompt = check_tokens(prompt_ids, self.cfg).reshape(1, -1)
    if prompt.shape[1] == 0:
      raise UserError("the prompt is empty: give at least one token")
    total = prompt.shape[1] + max_new_tokens
    if total > self.cfg.max_seq_len:
      raise UserError(f"prompt ({prompt.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) "
                       f"exceeds max_seq_len={self.cfg.max_seq_len}")
    if not 0.0 < top_p <= 1.0:
      raise UserError(f"top_p={top_p} must lie in (0, 1]")
    if temperature < 0:
      raise UserError(f"temperature={temperature} must be >= 0")
    logits, cache = self._prefill(self.params, self.rest, jnp.asarray(prompt, jnp.int32), total)
    key = jax.random.key(seed)
    key, sub = jax.random.split(key)
    token = sample(sub, logits[:, -1], temperature, top_p)
    counts = jnp.zeros((1, self.cfg.vocab_size), jnp.int32)
    for i in range(max_new_tokens):
      tid = int(token[0])
      yield tid
      if tid in stop_ids or i == max_new_tokens - 1:
        return
      key, sub = jax.random.split(key)
      token, cache, counts = self._decode(
          self.params, self.rest, cache, token, sub, jnp.float32(temperature),
          jnp.float32(top_p), counts, jnp.float32(frequency_penalty),
          jnp.float32(presence_penalty))


__all__ = ["Engine"]
