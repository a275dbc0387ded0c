"""Which drafted tokens a speculative verify step keeps, so the output is distributed exactly
as the target's (the model's, after penalties, bias, temperature and top-p).

A row's window holds its last token and k drafts d_1..d_k (the verify step's logits at
window position t predict the token after it). Position t's target distribution p_t is the
one a plain decode step would sample from there: the logits plus the row's bias (logit_bias
and -inf where a constraint forbids), penalised over the generated tokens including
d_1..d_t, scaled by the temperature, cut to the top-p nucleus (sampling.py).

Drafts come from a deterministic drafter (prompt lookup), a point mass on d_{t+1}, so the
standard rejection rule becomes: accept d_{t+1} with probability p_t(d_{t+1}); at the first
rejection emit a token from the residual (p_t with d_{t+1} removed, renormalised) and stop;
if every draft is accepted emit one more from p_k. Emitting x at a reached position then
has probability p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d] = p(x). Greedy rows
(temperature 0) reduce to: accept while d_{t+1} is the argmax, then emit the argmax.

Keys: position t of a row draws with the key of its token index (the request's seed folded
with steps + t), the one a plain decode step would use there, so a row without drafts gets
the plain step's token bit for bit; the acceptance coin and the residual draw use that key
folded with 1 and 2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3_jax.serve.sampling import nucleus, penalize, row_keys, sample


def target_logits(raw, counts, drafts, s):
  """raw [B, T, V] f32, counts [B, V] (tokens generated before the window), drafts [B, T-1]
  -> [B T, V]: each position's logits + bias, penalised over counts and the drafts before
  it."""
  b, t, v = raw.shape
  hot = jax.nn.one_hot(drafts, v, dtype=jnp.int32)                     # [B, T-1, V]
  before = jnp.concatenate([jnp.zeros((b, 1, v), jnp.int32), jnp.cumsum(hot, axis=1)], 1)
  rep = lambda a: jnp.repeat(a, t, axis=0)
  return penalize((raw + s.bias[:, None]).reshape(b * t, v),
                  (counts[:, None] + before).reshape(b * t, v), rep(s.frequency),
                  rep(s.presence))


def accept(raw, counts, drafts, ndraft, s):
  """raw [B, T, V] f32 verify logits, counts [B, V], drafts [B, T-1] int32 (row b's first
  ndraft[b] are real), s: the rows' Sampling -> (ids [B, T]: the drafts kept, then the
  emitted token, then filler; emitted [B]: how many of ids are the row's, 1..ndraft + 1)."""
  b, t, v = raw.shape
  rep = lambda a: jnp.repeat(a, t, axis=0)
  pen = target_logits(raw, counts, drafts, s)                          # [B T, V]
  temp, top_p = rep(s.temperature), rep(s.top_p)
  keys = row_keys(rep(s.seeds), (s.steps[:, None] + jnp.arange(t)[None]).reshape(-1))
  plain = sample(keys, pen, temp, top_p)                               # the decode's draw
  d = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1).reshape(-1)
  has = jnp.arange(t)[None] < ndraft[:, None]                          # [B, T]
  sampled = temp > 0

  def rejection(_):
    """-> (draft kept [B T], the token at a rejection / past the drafts [B T])."""
    scaled = pen / jnp.maximum(temp, 1e-6)[:, None]
    scaled = jax.lax.cond(jnp.any(sampled & (top_p < 1.0)), lambda z: nucleus(z, top_p),
                          lambda z: z, scaled)
    p_d = jnp.take_along_axis(jax.nn.softmax(scaled, axis=-1), d[:, None], axis=-1)[:, 0]
    coin = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)
    masked = jnp.where(jnp.arange(v)[None] == d[:, None], -jnp.inf, scaled)
    resid = jax.vmap(lambda k, z: jax.random.categorical(jax.random.fold_in(k, 2), z))(
        keys, masked).astype(jnp.int32)
    return (jnp.where(sampled, coin < p_d, d == plain),
            jnp.where(sampled & has.reshape(-1), resid, plain))

  # a greedy batch skips the probabilities and draws: kept while the draft is the argmax
  ok, final = jax.lax.cond(jnp.any(sampled), rejection, lambda _: (d == plain, plain), None)
  ok, final = ok.reshape(b, t), final.reshape(b, t)
  kept = jnp.sum(jnp.cumprod(ok & has, axis=1), axis=1).astype(jnp.int32)   # [B]
  ids = jnp.where(jnp.arange(t)[None] < kept[:, None], d.reshape(b, t), final)
  return ids.astype(jnp.int32), kept + 1


__all__ = ["target_logits", "accept"]
