"""Attention Residuals: the aggregation itself, block bookkeeping, and gradients."""

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.layers import attn_res


def _stream(num_sources=3, seed=0):
  x = jax.random.normal(jax.random.key(seed), (num_sources, 2, 5, 8))
  s = attn_res.init_stream(x[0], num_layers=8, block_size=4)      # bank of 3 slots
  for i in range(1, num_sources):
    s = attn_res.add_output(s, x[i])
    s = attn_res.close_block(s, True)
  return s, x


def test_zero_query_is_uniform_average_of_sources():
  s, x = _stream(3)
  h = attn_res.aggregate(jnp.zeros(8), s)
  np.testing.assert_allclose(h, x.mean(0), rtol=1e-6, atol=1e-6)
  # With a non-empty partial sum, it is one more (equally weighted) source.
  p = jax.random.normal(jax.random.key(9), (2, 5, 8))
  s2 = attn_res.add_output(s, p)
  np.testing.assert_allclose(attn_res.aggregate(jnp.zeros(8), s2),
                             (x.sum(0) + p) / 4, rtol=1e-6, atol=1e-6)


def test_first_sublayer_sees_only_the_embedding():
  emb = jax.random.normal(jax.random.key(1), (2, 5, 8))
  s = attn_res.init_stream(emb, num_layers=8, block_size=4)
  w = jax.random.normal(jax.random.key(2), (8,))
  np.testing.assert_allclose(attn_res.aggregate(w, s), emb, rtol=1e-6)


def test_softmax_over_normalised_keys():
  s, x = _stream(3)
  w = jax.random.normal(jax.random.key(3), (8,))
  keys = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)
  alpha = jax.nn.softmax(jnp.einsum("nbtd,d->nbt", keys, w), axis=0)
  np.testing.assert_allclose(attn_res.aggregate(w, s), jnp.einsum("nbt,nbtd->btd", alpha, x),
                             rtol=1e-5, atol=1e-6)


def test_block_boundary_moves_partial_into_bank():
  emb = jnp.ones((1, 2, 4))
  s = attn_res.init_stream(emb, num_layers=8, block_size=4)
  s = attn_res.add_output(s, 2 * emb)
  s = attn_res.close_block(s, False)              # not a boundary: nothing moves
  assert int(s["count"]) == 1 and bool(s["has_partial"])
  s = attn_res.add_output(s, 3 * emb)
  s = attn_res.close_block(s, True)
  assert int(s["count"]) == 2 and not bool(s["has_partial"])
  np.testing.assert_allclose(s["bank"][1], 5 * emb)
  np.testing.assert_allclose(s["partial"], 0 * emb)


def test_gradient_reaches_the_query():
  s, _ = _stream(3)
  g = jax.grad(lambda w: jnp.sum(attn_res.aggregate(w, s) ** 2))(jnp.zeros(8))
  assert float(jnp.abs(g).sum()) > 0
