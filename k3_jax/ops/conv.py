"""Depthwise causal short convolution (the KDA q/k/v conv), no bias, no
activation (the caller applies SiLU).

  y_t = sum_j weight[j] * x_{t - (W-1) + j}      weight [W, D]

Tap W-1 multiplies the current token, tap 0 the token W-1 steps back. Inputs
before the sequence come from `cache` [B, W-1, D] (oldest first; zeros = a
fresh sequence). Computed in float32, returned in x.dtype.

Packed sequences: with `segment_ids` [B, T], a new document starts wherever
segment_ids[t] != segment_ids[t-1]; the window of a token never reaches tokens
of another document (they count as zeros). The cache is treated as part of the
first document only (tokens before the first change), so with segment_ids the
cache reaches only the first document's tokens; in training segment_ids come
with cache=None. The returned cache holds the last W-1 inputs of the last
document (entries from earlier documents zeroed), so decoding continues the
last document.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3_jax.ops.segments import doc_index


def short_conv(x, weight, segment_ids=None, cache=None):
  """Causal depthwise conv over time.

  x [B, T, D]; weight [W, D]; segment_ids [B, T] int or None;
  cache [B, W-1, D] or None (zeros).
  Returns (y [B, T, D] in x.dtype, new_cache [B, W-1, D] in x.dtype).
  """
  B, T, D = x.shape
  W = weight.shape[0]
  w = weight.astype(jnp.float32)
  if cache is None:
    cache = jnp.zeros((B, W - 1, D), x.dtype)
  xp = jnp.concatenate([cache.astype(jnp.float32), x.astype(jnp.float32)],
                       axis=1)                                    # [B, W-1+T, D]
  if segment_ids is None:
    y = _taps(xp, w, None)                                       # [B, T, D]
    new_cache = xp[:, T:]
  else:
    doc = doc_index(segment_ids)                                 # [B, T]
    docp = jnp.concatenate([jnp.zeros((B, W - 1), doc.dtype), doc], axis=1)  # cache = doc 0
    masks = jnp.stack([docp[:, j:j + T] == doc for j in range(W)]).astype(jnp.float32)
    y = _taps(xp, w, masks)                                      # masks [W, B, T]
    same_as_last = (docp[:, T:] == doc[:, -1:])[..., None]        # [B, W-1, 1]
    new_cache = jnp.where(same_as_last, xp[:, T:], 0.0)
  return y.astype(x.dtype), new_cache.astype(x.dtype)


def _taps_fwd_value(xp, w, masks):
  """y_t = sum_j [masks_j(t)] w_j xp_{t+j}. xp [B, W-1+T, D] f32; w [W, D]; masks [W, B, T]."""
  W = w.shape[0]
  T = xp.shape[1] - (W - 1)
  if masks is None:
    return sum(w[j] * xp[:, j:j + T] for j in range(W))
  return sum(masks[j][..., None] * (w[j] * xp[:, j:j + T]) for j in range(W))


@jax.custom_vjp
def _taps(xp, w, masks):
  return _taps_fwd_value(xp, w, masks)


def _taps_fwd(xp, w, masks):
  return _taps_fwd_value(xp, w, masks), (xp, w, masks)


def _taps_bwd(res, dy):
  """Backward without W padded copies of dy: dy is padded ONCE and every tap reads a slice
  of it (dxp_s = sum_j w_j [m_j(s-j)] dy_{s-j}); the weight gradient is one reduction over
  (B, T) of the W shifted products. dy [B, T, D] -> (dxp [B, W-1+T, D], dw [W, D])."""
  xp, w, masks = res
  W = w.shape[0]
  T = dy.shape[1]
  L = T + W - 1
  pad = ((0, 0), (W - 1, W - 1), (0, 0))
  dyp = jnp.pad(dy, pad)                                          # [B, T+2(W-1), D]
  if masks is None:
    dxp = sum(w[j] * dyp[:, W - 1 - j:W - 1 - j + L] for j in range(W))
    dw = jnp.stack([jnp.sum(dy * xp[:, j:j + T], axis=(0, 1)) for j in range(W)])
  else:
    mp = jnp.pad(masks, ((0, 0), (0, 0), (W - 1, W - 1)))[..., None]   # [W, B, T+2(W-1), 1]
    dxp = sum(w[j] * (mp[j, :, W - 1 - j:W - 1 - j + L] * dyp[:, W - 1 - j:W - 1 - j + L])
              for j in range(W))
    dw = jnp.stack([jnp.sum(masks[j][..., None] * dy * xp[:, j:j + T], axis=(0, 1))
                    for j in range(W)])
  return dxp, dw, None if masks is None else jnp.zeros_like(masks)


_taps.defvjp(_taps_fwd, _taps_bwd)


def short_conv_step(x, weight, cache):
  """One decode token. x [B, D]; weight [W, D]; cache [B, W-1, D].
  Returns (y [B, D] in x.dtype, new_cache [B, W-1, D]).
  The taps are added in `short_conv`'s order (tap 0 first), so a decoded token's output is
  bitwise the one the sequence form gives it, and as elementwise adds the step is one fused
  loop (a reduction over W took one library call per conv on XLA:CPU, ~35 us each)."""
  xp = jnp.concatenate([cache.astype(jnp.float32),
                        x.astype(jnp.float32)[:, None]], axis=1)  # [B, W, D]
  w = weight.astype(jnp.float32)
  y = sum(w[j] * xp[:, j] for j in range(w.shape[0]))             # [B, D]
  return y.astype(x.dtype), xp[:, 1:].astype(cache.dtype)
