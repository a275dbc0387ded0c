"""Token sampling from logits: greedy, temperature, nucleus (top-p), and frequency /
presence penalties on the tokens generated so far."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(key: jax.Array, logits: jax.Array, temperature: float | jax.Array = 0.0,
           top_p: float | jax.Array = 1.0) -> jax.Array:
  """logits [B, V] -> token ids [B] int32. temperature 0 is greedy (argmax)."""
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  t = jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
  scaled = logits / t
  # Nucleus: keep the smallest set of tokens whose probability mass reaches top_p.
  sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = mass_before < top_p
  cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
  scaled = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
  sampled = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
  return jnp.where(jnp.asarray(temperature) > 0, sampled, greedy)


def penalize(logits: jax.Array, counts: jax.Array, frequency_penalty: float | jax.Array = 0.0,
             presence_penalty: float | jax.Array = 0.0) -> jax.Array:
  """logits [B, V] lowered by frequency_penalty x (times each token was generated so far)
  + presence_penalty x (1 if it was generated at all); counts [B, V]. As in the OpenAI API:
  small byte-level models otherwise repeat one token (whitespace) forever."""
  counts = counts.astype(jnp.float32)
  return (logits.astype(jnp.float32) - frequency_penalty * counts
          - presence_penalty * (counts > 0).astype(jnp.float32))
