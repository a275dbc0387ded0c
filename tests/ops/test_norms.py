"""RMSNorm tests."""

import jax.numpy as jnp
import numpy as np

from k3_jax.ops.norms import rms_norm


def _np_rms_norm(x, w, eps):
  x = x.astype(np.float64)
  y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  return y if w is None else y * w


def test_rms_norm_matches_numpy():
  rng = np.random.default_rng(0)
  x = rng.normal(scale=3.0, size=(4, 5, 64)).astype(np.float32)
  w = rng.normal(size=(64,)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(w))),
                             _np_rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(x))),
                             _np_rms_norm(x, None, 1e-5), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(x), eps=1e-2)),
                             _np_rms_norm(x, None, 1e-2), rtol=1e-5, atol=1e-6)


def test_rms_norm_unit_rms_and_zero_input():
  x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 32)), jnp.float32)
  y = rms_norm(x, eps=0.0)
  np.testing.assert_allclose(np.sqrt(np.mean(np.asarray(y) ** 2, axis=-1)), 1.0, rtol=1e-5)
  z = rms_norm(jnp.zeros((2, 16)))
  assert np.all(np.asarray(z) == 0.0)


def test_rms_norm_bf16_keeps_dtype_and_uses_f32():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(scale=100.0, size=(16, 128)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(128,)), jnp.bfloat16)
  y = rms_norm(x, w)
  assert y.dtype == jnp.bfloat16
  ref = _np_rms_norm(np.asarray(x, np.float32), np.asarray(w, np.float32), 1e-5)
  np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=1e-2, atol=1e-2)
