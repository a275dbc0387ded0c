"""Token sampling from logits: greedy, temperature, nucleus (top-p), presence and frequency
penalties, per row (each row of a batch is a different request with its own parameters)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(key: jax.Array, logits: jax.Array, temperature: float | jax.Array = 0.0,
           top_p: float | jax.Array = 1.0) -> jax.Array:
  """logits [B, V] -> token ids [B] int32. temperature 0 is greedy (argmax); temperature and
  top_p may be scalars or per-row [B]; `key` is one key for the batch, or [B] keys (one per
  row, so a row's draw does not depend on the other rows)."""
  logits = logits.astype(jnp.float32)
  b = logits.shape[0]
  temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,))
  top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,))
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  t = jnp.maximum(temperature, 1e-6)[:, None]
  scaled = logits / t

  # The sort over the vocabulary (163,840 ids for K3) runs only when some sampled row asks
  # for a nucleus: greedy and top_p = 1 batches skip it.
  scaled = jax.lax.cond(jnp.any((temperature > 0) & (top_p < 1.0)),
                        lambda s: nucleus(s, top_p), lambda s: s, scaled)

  def draw(scaled):
    if jnp.ndim(key) == 0:              # one typed key for the whole batch
      return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    return jax.vmap(lambda k, s: jax.random.categorical(k, s))(key, scaled).astype(jnp.int32)

  # The random draw ([B, V] Gumbel noise) runs only when some row samples: a greedy batch
  # skips it.
  sampled = jax.lax.cond(jnp.any(temperature > 0), draw, lambda s: greedy, scaled)
  return jnp.where(temperature > 0, sampled, greedy)


def nucleus(scaled: jax.Array, top_p: jax.Array) -> jax.Array:
  """scaled [B, V] with -inf outside the smallest set of tokens whose probability mass
  reaches top_p [B] (rows with top_p = 1 keep every token)."""
  sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
  cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def penalize(logits: jax.Array, counts: jax.Array, frequency_penalty: float | jax.Array = 0.0,
             presence_penalty: float | jax.Array = 0.0) -> jax.Array:
  """OpenAI-style penalties over the tokens generated so far: logits [B, V] lowered by
  frequency_penalty x (times each token was generated) + presence_penalty x (1 if it was
  generated at all); counts [B, V]. The penalties are scalars or per row [B]. Small
  byte-level models otherwise repeat one token (whitespace) forever."""
  per_row = lambda p: jnp.asarray(p, jnp.float32).reshape(-1, 1) if jnp.ndim(p) else p
  c = counts.astype(jnp.float32)
  return (logits.astype(jnp.float32) - per_row(frequency_penalty) * c
          - per_row(presence_penalty) * (c > 0).astype(jnp.float32))


def row_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
  """[B] keys: the request's seed folded with its own token index, so a request's samples
  depend only on its seed (not on which slot or batch it ran in)."""
  return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seeds, steps)


def sample_rows(logits, counts, seeds, steps, temperature, top_p, presence, frequency):
  """The engine's per-row sampler: penalties, then temperature / top-p with per-row keys.
  -> token ids [B] int32."""
  logits = penalize(logits, counts, frequency, presence)
  return sample(row_keys(seeds, steps), logits, temperature, top_p)
