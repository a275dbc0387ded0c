"""SiTU-GLU / SwiGLU activation tests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.ops.activations import glu, situ_glu, swiglu


def _np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def test_situ_glu_matches_formula():
  rng = np.random.default_rng(0)
  g = rng.normal(scale=10.0, size=(64, 32)).astype(np.float32)
  u = rng.normal(scale=40.0, size=(64, 32)).astype(np.float32)
  want = (4.0 * np.tanh(g / 4.0) * _np_sigmoid(g)) * (25.0 * np.tanh(u / 25.0))
  got = situ_glu(jnp.asarray(g), jnp.asarray(u))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  # Non-default betas.
  want2 = (2.0 * np.tanh(g / 2.0) * _np_sigmoid(g)) * (3.0 * np.tanh(u / 3.0))
  got2 = situ_glu(jnp.asarray(g), jnp.asarray(u), beta1=2.0, beta2=3.0)
  np.testing.assert_allclose(np.asarray(got2), want2, rtol=1e-5, atol=1e-5)


def test_situ_glu_bounded_by_beta_product():
  big = jnp.array([-1e6, -100.0, -5.0, 0.0, 5.0, 100.0, 1e6], jnp.float32)
  g, u = jnp.meshgrid(big, big)
  out = situ_glu(g, u)
  assert bool(jnp.all(jnp.isfinite(out)))
  assert float(jnp.max(jnp.abs(out))) <= 4.0 * 25.0
  # The bound is approached for large positive gate and large |up|.
  assert float(situ_glu(jnp.float32(1e6), jnp.float32(1e6))) == pytest.approx(100.0)


def test_situ_glu_matches_swiglu_near_zero():
  rng = np.random.default_rng(1)
  g = jnp.asarray(rng.uniform(-0.1, 0.1, size=(1000,)).astype(np.float32))
  u = jnp.asarray(rng.uniform(-0.1, 0.1, size=(1000,)).astype(np.float32))
  situ = situ_glu(g, u)
  swi = swiglu(g, u)
  # b tanh(x/b) = x - x^3/(3 b^2) + ..., so the relative error is O(x^2 / b^2).
  rel = jnp.abs(situ - swi) / (jnp.abs(swi) + 1e-12)
  assert float(jnp.max(rel)) < 1e-3
  # And the first derivatives at 0 agree.
  dsitu = jax.grad(lambda a, b: situ_glu(a, b), argnums=(0, 1))(0.0, 0.05)
  dswi = jax.grad(lambda a, b: swiglu(a, b), argnums=(0, 1))(0.0, 0.05)
  np.testing.assert_allclose(np.array(dsitu), np.array(dswi), rtol=1e-4)


def test_swiglu_matches_formula():
  rng = np.random.default_rng(2)
  g = rng.normal(size=(16, 8)).astype(np.float32)
  u = rng.normal(size=(16, 8)).astype(np.float32)
  want = g * _np_sigmoid(g) * u
  np.testing.assert_allclose(np.asarray(swiglu(jnp.asarray(g), jnp.asarray(u))), want,
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", [situ_glu, swiglu])
def test_bf16_inputs_computed_in_f32(fn):
  rng = np.random.default_rng(3)
  g = jnp.asarray(rng.normal(scale=3.0, size=(256,)), jnp.bfloat16)
  u = jnp.asarray(rng.normal(scale=3.0, size=(256,)), jnp.bfloat16)
  out = fn(g, u)
  assert out.dtype == jnp.bfloat16
  # Result equals the f32 computation on the same (bf16-representable) values,
  # rounded once to bf16.
  ref = fn(g.astype(jnp.float32), u.astype(jnp.float32)).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
  # The jaxpr does the math in f32: only the input casts see bf16 and only the
  # final cast produces it.
  jaxpr = jax.make_jaxpr(fn)(g, u)
  bf16_out = [eq.primitive.name for eq in jaxpr.eqns
              if any(v.aval.dtype == jnp.bfloat16 for v in eq.outvars)]
  assert bf16_out == ["convert_element_type"]
  assert jaxpr.eqns[-1].primitive.name == "convert_element_type"

def test_glu_dispatch():
  g = jnp.linspace(-3, 3, 7)
  u = jnp.linspace(-2, 2, 7)
  np.testing.assert_array_equal(glu(g, u, "situ"), situ_glu(g, u))
  np.testing.assert_array_equal(glu(g, u, "situ", beta1=2.0, beta2=5.0),
                                situ_glu(g, u, beta1=2.0, beta2=5.0))
  np.testing.assert_array_equal(glu(g, u, "swiglu"), swiglu(g, u))
  with pytest.raises(ValueError, match="unknown GLU activation kind 'relu'"):
    glu(g, u, "relu")
