"""RMSNorm with a learned gain (the op lives in k3_jax.ops.norms)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3_jax.ops.norms import rms_norm


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32,
               axis_name: str = "norm"):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=(axis_name,))

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.weight[...], self.eps)
