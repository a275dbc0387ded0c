"""Normalisation ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None = None,
             eps: float = 1e-5) -> jax.Array:
  """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight.

  x: [..., D]; weight: [D] or None (no gain). Computed in float32, returned in
  x.dtype.
  """
  xf = x.astype(jnp.float32)
  ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)  # [..., 1]
  y = xf * jax.lax.rsqrt(ms + eps)
  if weight is not None:
    y = y * weight.astype(jnp.float32)
  return y.astype(x.dtype)
