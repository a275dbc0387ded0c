"""Softmax attention references for Gated MLA: masks, plain and weight-absorbed forms, and
the plain-form latent attention (expand the latent KV, then attend).

Logits, softmax and accumulation in FP32. Both forms also return each head's maximum
pre-softmax logit over the batch (what QK-Clip watches), taken from logits they compute
anyway.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30


def causal_mask(q_pos: jax.Array, kv_pos: jax.Array, q_seg: jax.Array | None = None,
                kv_seg: jax.Array | None = None) -> jax.Array:
  """[B, T, S] bool: key s is visible to query t if kv_pos <= q_pos (and same segment)."""
  mask = kv_pos[:, None, :] <= q_pos[:, :, None]
  if q_seg is not None:
    mask = mask & (q_seg[:, :, None] == kv_seg[:, None, :])
  return mask


def _softmax_masked(logits: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """logits [B, H, T, S] f32, mask [B, T, S] -> (probs, per-head max logit [H])."""
  m = mask[:, None]
  logits = jnp.where(m, logits, _NEG)
  max_logit = jnp.max(jnp.where(m, logits, -jnp.inf), axis=(0, 2, 3))
  return jax.nn.softmax(logits, axis=-1), max_logit


def attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
              mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """q [B, T, H, Dk], k [B, S, H, Dk], v [B, S, H, Dv], mask [B, T, S]
  -> (o [B, T, H, Dv] in v.dtype, max_logit [H] f32)."""
  logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
  p, max_logit = _softmax_masked(logits, mask)
  o = jnp.einsum("bhts,bshd->bthd", p, v.astype(jnp.float32),
                 preferred_element_type=jnp.float32)
  return o.astype(v.dtype), max_logit


def absorbed_attention(q_latent: jax.Array, q_rope: jax.Array, c_kv: jax.Array,
                       k_rope: jax.Array, scale: float,
                       mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """MLA with W_kvb absorbed into the query: attends directly over the cached latents.

  q_latent [B, T, H, R] (= q_nope . W_kvb_k), q_rope [B, T, H, P], c_kv [B, S, R],
  k_rope [B, S, P] (shared by all heads), mask [B, T, S]
  -> (latent output [B, T, H, R] f32, to be multiplied by W_kvb_v; max_logit [H]).
  """
  logits = (jnp.einsum("bthr,bsr->bhts", q_latent, c_kv, preferred_element_type=jnp.float32)
            + jnp.einsum("bthp,bsp->bhts", q_rope, k_rope,
                         preferred_element_type=jnp.float32)) * scale
  p, max_logit = _softmax_masked(logits, mask)
  o = jnp.einsum("bhts,bsr->bthr", p, c_kv.astype(jnp.float32),
                 preferred_element_type=jnp.float32)
  return o, max_logit


def latent_attention(q_nope, q_rope, c_kv, k_r, w_kvb, scale: float, dtype,
                     q_segment_ids=None, kv_segment_ids=None, q_offset=0):
  """Plain-form MLA attention (training): expand the latent KV with W_kvb and attend.

  q_nope [B, T, H, n], q_rope [B, T, H, p] at positions q_offset + [0, T); c_kv [B, S, R],
  k_r [B, S, p] (shared by all heads) at positions [0, S); w_kvb [R, H, n + v]; segment
  ids [B, T] / [B, S] or None. Causal by position (and same segment).
  Returns (o [B, T, H, v] in dtype, max_logit [H])."""
  b, t, _, n = q_nope.shape
  s = c_kv.shape[1]
  kv = jax.lax.dot_general(c_kv.astype(dtype), w_kvb.astype(dtype), (((2,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32).astype(dtype)  # [B, S, H, n + v]
  k_nope, v = kv[..., :n], kv[..., n:]
  k = jnp.concatenate(
      [k_nope, jnp.broadcast_to(k_r[:, :, None, :], k_nope.shape[:3] + (k_r.shape[-1],))],
      axis=-1)
  q = jnp.concatenate([q_nope, q_rope], axis=-1)
  q_pos = jnp.broadcast_to(q_offset + jnp.arange(t)[None], (b, t))
  kv_pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
  mask = causal_mask(q_pos, kv_pos, q_segment_ids, kv_segment_ids)
  return attention(q, k, v, scale, mask)
