"""KDA by its definition: a scan over tokens (the reference of every other form), and the
one-token decode step. Shapes and semantics: see k3_jax/ops/kda/__init__.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3_jax.ops.kda.common import (check_chunk_shapes, check_decode_shapes, default_scale,
                                   doc_index, pad_time)

# Tokens per checkpointed block in recurrent_kda: the backward pass keeps one
# state per block (not per token) and recomputes the block's states.
RECURRENT_BLOCK = 64


def _delta_step(state, q, k, v, g, beta):
  """One token, float32. state [B, H, K, V]; q, k, g [B, H, K]; v [B, H, V];
  beta [B, H]. q already scaled. Returns (new_state, o [B, H, V])."""
  state = jnp.exp(g)[..., None] * state                           # decay rows
  pred = jnp.einsum("bhk,bhkv->bhv", k, state)                    # k^T S
  delta = beta[..., None] * (v - pred)                            # [B, H, V]
  state = state + k[..., None] * delta[..., None, :]              # += k delta^T
  o = jnp.einsum("bhk,bhkv->bhv", q, state)                       # S^T q
  return state, o


def kda_decode_step(q, k, v, g, beta, state, scale=None):
  """One decode step.

  q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V] float32.
  Returns (o [B, H, V] in v.dtype, new_state [B, H, K, V] float32).
  """
  check_decode_shapes(q, k, v, g, beta, state)
  f32 = lambda x: x.astype(jnp.float32)
  scale = default_scale(scale, q.shape[-1])
  new_state, o = _delta_step(f32(state), f32(q) * scale, f32(k), f32(v),
                             f32(g), f32(beta))
  return o.astype(v.dtype), new_state


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None,
                  output_final_state=False, segment_ids=None):
  """KDA by a scan over tokens (the reference definition).

  q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
  initial_state [B, H, K, V] (float32, zeros if None);
  segment_ids [B, T] int or None: the state is reset to zero before every token
  whose id differs from the previous token's (initial_state only reaches the
  first document).
  Returns (o [B, T, H, V] in v.dtype, final_state [B, H, K, V] f32 or None).

  The scan runs over blocks of RECURRENT_BLOCK tokens, each block a
  rematerialized inner scan, so reverse-mode autodiff stores one state per
  block instead of one per token. Padding tokens (k = v = g = beta = 0) leave
  the state unchanged.
  """
  B, T, H, K, V = check_chunk_shapes(q, k, v, g, beta, initial_state, segment_ids)
  scale = default_scale(scale, K)
  out_dtype = v.dtype
  f32 = lambda x: x.astype(jnp.float32)
  q, k, v, g, beta = f32(q) * scale, f32(k), f32(v), f32(g), f32(beta)
  if initial_state is None:
    state0 = jnp.zeros((B, H, K, V), jnp.float32)
  else:
    state0 = f32(initial_state)
  if segment_ids is None:
    reset = jnp.zeros((B, T), jnp.bool_)
  else:
    doc = doc_index(segment_ids)                                 # [B, T]
    reset = jnp.concatenate(
        [jnp.zeros((B, 1), jnp.bool_), doc[:, 1:] != doc[:, :-1]], axis=1)

  blk = min(RECURRENT_BLOCK, T)
  n_blk = -(-T // blk)
  pad = n_blk * blk - T
  # [B, T, ...] -> [n_blk, blk, B, ...] (time-major for the scans)
  def to_blocks(x):
    x = pad_time(x, pad)
    x = x.reshape((B, n_blk, blk) + x.shape[2:])
    return jnp.moveaxis(x, (1, 2), (0, 1))
  xs = tuple(to_blocks(x) for x in (q, k, v, g, beta, reset))

  def token_step(state, inp):
    q_t, k_t, v_t, g_t, b_t, r_t = inp
    state = jnp.where(r_t[:, None, None, None], 0.0, state)       # doc boundary
    return _delta_step(state, q_t, k_t, v_t, g_t, b_t)

  @jax.checkpoint
  def block_step(state, inp):
    return jax.lax.scan(token_step, state, inp)

  final_state, o = jax.lax.scan(block_step, state0, xs)           # o [n, blk, B, H, V]
  o = jnp.moveaxis(o, (0, 1), (1, 2)).reshape(B, n_blk * blk, H, V)[:, :T]
  return o.astype(out_dtype), (final_state if output_final_state else None)


__all__ = ["recurrent_kda", "kda_decode_step", "RECURRENT_BLOCK"]
