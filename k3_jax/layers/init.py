"""Where initial parameter values come from.

`Init` hands out values in one of three modes:
  numpy     drawn on the host with numpy (the default for real models on one host: fast,
            nothing to compile; XLA:CPU takes seconds to compile each batch of threefry
            draws, about 15 s for 20 normal draws measured here)
  jax       drawn with jax.random from fold_in(key, counter): traceable, for the jitted,
            sharded initialisation (k3_jax/train.py) that creates every parameter directly
            in its shards; `children()` gives independent streams for stacked layers
  abstract  zeros, used under jax.eval_shape: shapes and dtypes only, nothing allocated
All modes give the same shapes and dtypes, so graph definitions are interchangeable.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# Standard deviation of a standard normal truncated to [-2, 2].
_TRUNC2_STD = 0.8796256610342398


class Init:
  def __init__(self, seed: int = 0, mode: str = "numpy", key: jax.Array | None = None):
    if mode not in ("numpy", "jax", "abstract"):
      raise ValueError(f"Init mode {mode!r}: must be 'numpy', 'jax' or 'abstract'")
    self.mode = mode
    self._np = np.random.default_rng(seed) if mode == "numpy" else None
    self._key = (key if key is not None else jax.random.key(seed)) if mode == "jax" else None
    self._count = 0

  def children(self):
    """jax mode: a function index -> Init with a stream of its own, fold_in(k, index) where
    k is this Init's next key. `index` may be a tracer: under jax.vmap over the indices of
    stacked layers every leaf is drawn as one [R, ...] array (one draw, not R)."""
    if self.mode != "jax":
      raise ValueError(f"Init.children is for mode 'jax', not {self.mode!r}")
    base = self._next_key()
    return lambda index: Init(mode="jax", key=jax.random.fold_in(base, index))

  def _next_key(self) -> jax.Array:
    self._count += 1
    return jax.random.fold_in(self._key, self._count)

  def normal(self, shape, std: float, dtype=jnp.float32) -> jax.Array:
    """Normal truncated at 2 standard deviations, rescaled to have standard deviation std."""
    shape = tuple(shape)
    if self.mode == "abstract":
      return jnp.zeros(shape, dtype)
    if self.mode == "jax":
      x = jax.random.truncated_normal(self._next_key(), -2.0, 2.0, shape, jnp.float32)
      return (x * (std / _TRUNC2_STD)).astype(dtype)
    x = self._np.standard_normal(math.prod(shape))
    bad = np.abs(x) > 2.0
    while bad.any():                      # resample the tails: a truncated normal
      x[bad] = self._np.standard_normal(int(bad.sum()))
      bad = np.abs(x) > 2.0
    return jnp.asarray((x * (std / _TRUNC2_STD)).reshape(shape), dtype)

  def uniform(self, shape, low: float, high: float, dtype=jnp.float32) -> jax.Array:
    shape = tuple(shape)
    if self.mode == "abstract":
      return jnp.zeros(shape, dtype)
    if self.mode == "jax":
      return jax.random.uniform(self._next_key(), shape, dtype, low, high)
    return jnp.asarray(self._np.uniform(low, high, shape), dtype)
