"""KDA's gates and input normalization (docs/architecture.md section 2): the per-channel log decay
g <= 0 of K3 (lower bound) and of Kimi Linear (softplus), and the q / k L2 normalization.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / sqrt(sum(x^2, -1) + eps), computed in float32, returned in x.dtype."""
  x32 = x.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * inv).astype(x.dtype)


def kda_gate_lower_bound(z: jax.Array, a_log: jax.Array,
                         g_min: float = -5.0) -> jax.Array:
  """K3 decay: g = g_min * sigmoid(exp(a_log) * z), in (g_min, 0).

  z [..., H, K] decay logits; a_log [H] per-head log scale. Returns float32.
  """
  a = jnp.exp(a_log.astype(jnp.float32))[:, None]                 # [H, 1]
  return g_min * jax.nn.sigmoid(a * z.astype(jnp.float32))        # [..., H, K]


def kda_gate_softplus(z: jax.Array, a_log: jax.Array) -> jax.Array:
  """Kimi-Linear decay: g = -exp(a_log) * softplus(z), in (-inf, 0).

  z [..., H, K] decay logits; a_log [H] per-head log scale. Returns float32.
  """
  a = jnp.exp(a_log.astype(jnp.float32))[:, None]                 # [H, 1]
  return -a * jax.nn.softplus(z.astype(jnp.float32))              # [..., H, K]


__all__ = ["l2_normalize", "kda_gate_lower_bound", "kda_gate_softplus"]
