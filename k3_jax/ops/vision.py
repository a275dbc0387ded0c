"""Vision encoder math (MoonViT, docs/architecture.md section 8), in plain JAX / numpy.

Packed layout: the patches of several images of different sizes are concatenated into one
sequence of N patches (raster order within each image, images one after another). Per-patch
index arrays, computed on the host from the image grids (k3_jax/data/images.py), carry
everything that depends on the grids, so one compiled encoder serves any packing of the same
total size:

    patches     f32   [N, P]      P = 3 * patch * patch pixels, (channel, row, col) order
    pos_hw      int32 [N, 2]      (row, col) of the patch in its image's patch grid
    interp_idx  int32 [N, 16]     bicubic taps into the flattened [S*S] position table
    interp_w    f32   [N, 16]     their weights
    segment_ids int32 [N]         1, 2, ... per image; 0 = padding
    merge_idx   int32 [M, 4]      the 2 x 2 neighbours (raster order) of each merged token

Attention is block-diagonal per image (segment ids); padding attends only to padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_NEG = -1e30
_KEYS_A = -0.75     # the bicubic (Keys) kernel parameter of torch's F.interpolate


# ----- learned position table, resampled to each image's grid ----------------------------

def bicubic_taps(size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
  """Taps and weights resampling an axis of length `side` to length `size`, as torch's
  F.interpolate(mode="bicubic", align_corners=False) does (half-pixel centres, Keys kernel
  a = -0.75, out-of-range taps clamped to the border). -> (taps int [size, 4], w f32 [size, 4])."""
  dst = np.arange(size, dtype=np.float64)
  src = (dst + 0.5) * side / size - 0.5
  floor = np.floor(src)
  offsets = np.arange(-1, 3)
  taps = floor[:, None].astype(np.int64) + offsets                   # [size, 4]
  d = np.abs(src[:, None] - floor[:, None] - offsets)                # distances in [0, 2]
  a = _KEYS_A
  near = ((a + 2) * d - (a + 3)) * d * d + 1
  far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
  w = np.where(d <= 1, near, far)
  return np.clip(taps, 0, side - 1), w.astype(np.float32)


def interp_taps(h: int, w: int, side: int) -> tuple[np.ndarray, np.ndarray]:
  """Bicubic taps of an [h, w] grid into a flattened [side*side] table, raster order.
  -> (idx int32 [h*w, 16], weights f32 [h*w, 16])."""
  ht, hw = bicubic_taps(h, side)
  wt, ww = bicubic_taps(w, side)
  idx = ht[:, None, :, None] * side + wt[None, :, None, :]            # [h, w, 4, 4]
  wts = hw[:, None, :, None] * ww[None, :, None, :]
  return idx.reshape(h * w, 16).astype(np.int32), wts.reshape(h * w, 16).astype(np.float32)


def interpolate_positions(table: jax.Array, idx: jax.Array, weights: jax.Array) -> jax.Array:
  """table [S, S, D], idx/weights [N, 16] -> position embeddings [N, D] (f32)."""
  flat = table.reshape(-1, table.shape[-1]).astype(jnp.float32)      # [S*S, D]
  return jnp.einsum("nt,ntd->nd", weights.astype(jnp.float32), flat[idx])


# ----- 2-D rotary positions -----------------------------------------------------------

def rope_2d_angles(pos_hw: jax.Array, head_dim: int, theta: float = 10000.0) -> jax.Array:
  """pos_hw int [N, 2] (row, col) -> angles f32 [N, head_dim/2], one per complex pair.

  Pair 2i turns by col * f_i and pair 2i+1 by row * f_i, f_i = theta^(-4i/head_dim), i <
  head_dim/4: the complex pairs alternate x (column) and y (row) frequencies."""
  if head_dim % 4:
    raise ValueError(f"2-D RoPE needs head_dim divisible by 4, got {head_dim}")
  freqs = theta ** (-4.0 * jnp.arange(head_dim // 4, dtype=jnp.float32) / head_dim)  # [K/4]
  pos = pos_hw.astype(jnp.float32)
  x = pos[:, 1:2] * freqs                                             # [N, K/4]
  y = pos[:, 0:1] * freqs
  return jnp.stack([x, y], axis=-1).reshape(pos.shape[0], head_dim // 2)


def apply_rope_2d(x: jax.Array, angles: jax.Array) -> jax.Array:
  """x [N, H, K] (consecutive elements form the complex pairs), angles [N, K/2] -> x rotated
  (computed in f32, returned in x.dtype)."""
  xf = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
  re, im = xf[..., 0], xf[..., 1]                                     # [N, H, K/2]
  c, s = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
  out = jnp.stack([re * c - im * s, re * s + im * c], axis=-1)
  return out.reshape(x.shape).astype(x.dtype)


# ----- attention, activations, merge ----------------------------------------------------

def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                      scale: float) -> jax.Array:
  """Bidirectional attention within each image: q, k, v [N, H, K], segment_ids [N]
  -> o [N, H, K] in v.dtype. Logits, softmax and accumulation in f32."""
  logits = jnp.einsum("nhk,mhk->hnm", q, k, preferred_element_type=jnp.float32) * scale
  mask = segment_ids[:, None] == segment_ids[None, :]                # [N, N]
  p = jax.nn.softmax(jnp.where(mask[None], logits, _NEG), axis=-1)
  o = jnp.einsum("hnm,mhk->nhk", p, v.astype(jnp.float32), preferred_element_type=jnp.float32)
  return o.astype(v.dtype)


def gelu_tanh(x: jax.Array) -> jax.Array:
  return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


def gelu(x: jax.Array) -> jax.Array:
  return jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
  """LayerNorm over the last axis, f32 inside, returned in x.dtype."""
  xf = x.astype(jnp.float32)
  mu = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
  y = (xf - mu) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
  return y.astype(x.dtype)


def merge_taps(h: int, w: int, offset: int = 0, k: int = 2) -> np.ndarray:
  """Indices of the k x k neighbours of each merged token of an [h, w] grid starting at patch
  `offset` of the packed sequence: int32 [h*w/k^2, k*k], neighbours in raster order."""
  if h % k or w % k:
    raise ValueError(f"patch grid {h}x{w} is not divisible by the {k}x{k} merge")
  grid = np.arange(h * w).reshape(h // k, k, w // k, k).transpose(0, 2, 1, 3)
  return (grid.reshape(-1, k * k) + offset).astype(np.int32)


def merge_patches(x: jax.Array, merge_idx: jax.Array) -> jax.Array:
  """x [N, D], merge_idx [M, 4] -> [M, 4D]: each merged token is its 2 x 2 neighbours' features
  side by side (single frames: the mean over time is the identity)."""
  return x[merge_idx].reshape(merge_idx.shape[0], -1)


# ----- the text side -----------------------------------------------------------------

def scatter_features(x: jax.Array, tokens: jax.Array, features: jax.Array,
                     placeholder_id: int) -> jax.Array:
  """Replaces the embeddings of placeholder tokens, in order (row-major over [B, T]), by the
  image features. x [B, T, D], tokens [B, T], features [M, D] -> [B, T, D].

  The host checks that the counts match (k3_jax/data/images.check_placeholders); under jit a
  surplus placeholder would repeat the last feature, a surplus feature is dropped."""
  b, t, d = x.shape
  mask = (tokens == placeholder_id).reshape(-1)                      # [B*T]
  order = jnp.clip(jnp.cumsum(mask) - 1, 0, features.shape[0] - 1)   # placeholder's rank
  picked = features.astype(x.dtype)[order]                           # [B*T, D]
  return jnp.where(mask[:, None], picked, x.reshape(-1, d)).reshape(b, t, d)


__all__ = ["bicubic_taps", "interp_taps", "interpolate_positions", "rope_2d_angles",
           "apply_rope_2d", "segment_attention", "gelu_tanh", "gelu", "layer_norm",
           "merge_taps", "merge_patches", "scatter_features"]
