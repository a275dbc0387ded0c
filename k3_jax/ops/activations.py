"""Gated linear unit activations: SiTU-GLU (K3) and SwiGLU (Kimi Linear).

All functions compute in float32 and return the dtype of `gate`.

SiTU-GLU (spec section 5):
    out = [b1 tanh(G/b1) * sigmoid(G)] * [b2 tanh(U/b2)]
Near 0 the soft clamps b*tanh(x/b) are the identity, so SiTU-GLU matches
SwiGLU = silu(G) * U to first order; it is bounded by b1 * b2 (100 for K3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GLU_KINDS = ("situ", "swiglu")


def situ_glu(gate: jax.Array, up: jax.Array, beta1: float = 4.0,
             beta2: float = 25.0) -> jax.Array:
  """SiTU-GLU: (b1 tanh(g/b1) sigmoid(g)) * (b2 tanh(u/b2)), f32 inside."""
  g = gate.astype(jnp.float32)
  u = up.astype(jnp.float32)
  gate_path = beta1 * jnp.tanh(g / beta1) * jax.nn.sigmoid(g)  # |.| < beta1
  up_path = beta2 * jnp.tanh(u / beta2)                        # |.| < beta2
  return (gate_path * up_path).astype(gate.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  """SwiGLU: silu(g) * u, f32 inside."""
  g = gate.astype(jnp.float32)
  u = up.astype(jnp.float32)
  return (jax.nn.silu(g) * u).astype(gate.dtype)


def glu(gate: jax.Array, up: jax.Array, kind: str, beta1: float = 4.0,
        beta2: float = 25.0) -> jax.Array:
  """Dispatch on `kind`: "situ" (SiTU-GLU) or "swiglu"."""
  if kind == "situ":
    return situ_glu(gate, up, beta1=beta1, beta2=beta2)
  if kind == "swiglu":
    return swiglu(gate, up)
  raise ValueError(f"unknown GLU activation kind {kind!r}; expected one of {GLU_KINDS}")
