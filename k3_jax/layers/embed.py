"""Token embedding and the (untied) LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3_jax.layers.init import Init


class Embed(nnx.Module):
  def __init__(self, vocab_size: int, dim: int, *, init: Init, dtype=jnp.float32,
               param_dtype=jnp.float32):
    self.dtype = dtype
    self.table = nnx.Param(init.normal((vocab_size, dim), 1.0, param_dtype),
                           logical_axes=("vocab", "embed"))

  def __call__(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, D]
    return jnp.take(self.table[...], tokens, axis=0).astype(self.dtype)


class LMHead(nnx.Module):
  def __init__(self, dim: int, vocab_size: int, *, init: Init, dtype=jnp.float32,
               param_dtype=jnp.float32):
    self.dtype = dtype
    self.w = nnx.Param(init.normal((dim, vocab_size), dim ** -0.5, param_dtype),
                       logical_axes=("embed", "vocab"))

  def __call__(self, x: jax.Array) -> jax.Array:  # [B, T, D] -> [B, T, vocab] float32
    return jnp.einsum("btd,dv->btv", x.astype(self.dtype), self.w[...].astype(self.dtype),
                      preferred_element_type=jnp.float32)
