"""Blockwise (flash-style) absorbed MLA attention equals the one-softmax absorbed form under
the same causal mask, for block sizes that divide the lengths and ones that do not (padded
queries and keys), with queries at an offset into the cache (a chunked prefill)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.ops import attention as attn_ops


@pytest.mark.parametrize("block_q,block_k", [(8, 8), (5, 16), (64, 64), (1, 7)])
def test_blockwise_absorbed_equals_absorbed(block_q, block_k):
  b, t, h, r, p, s = 2, 37, 3, 16, 8, 53
  k = jax.random.split(jax.random.key(0), 4)
  q_lat, q_rope = jax.random.normal(k[0], (b, t, h, r)), jax.random.normal(k[1], (b, t, h, p))
  c_kv, k_rope = jax.random.normal(k[2], (b, s, r)), jax.random.normal(k[3], (b, s, p))
  # Row 0's queries start at position 5, row 1's at 16 (earlier keys are the cached prefix;
  # keys past a query's position are masked, as are the unwritten cache slots).
  q_pos = jnp.array([[5], [16]], jnp.int32) + jnp.arange(t)[None]
  kv_pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
  want, want_max = attn_ops.absorbed_attention(q_lat, q_rope, c_kv, k_rope, 0.125,
                                               attn_ops.causal_mask(q_pos, kv_pos))
  got, got_max = jax.jit(lambda *a: attn_ops.blockwise_absorbed_attention(
      *a, 0.125, q_pos, block_q=block_q, block_k=block_k))(q_lat, q_rope, c_kv, k_rope)
  # FP32; the online softmax sums in another order: ~1e-7 of the outputs' scale (O(1)).
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
  np.testing.assert_allclose(got_max, want_max, rtol=0, atol=2e-6)


def test_a_query_that_sees_nothing_gets_zero():
  q = jnp.ones((1, 2, 1, 4))
  c = jnp.ones((1, 3, 4))
  o, m = attn_ops.blockwise_absorbed_attention(q, q[..., :2], c, c[..., :2], 1.0,
                                               jnp.array([[-1, 0]]), block_k=2)
  np.testing.assert_array_equal(o[0, 0], 0.0)
  np.testing.assert_allclose(o[0, 1], 1.0)
  assert float(m[0]) == 6.0
