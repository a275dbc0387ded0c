"""Softmax attention references for Gated MLA: masks, plain and weight-absorbed forms.

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
