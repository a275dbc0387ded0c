"""Blockwise (flash-style) absorbed MLA attention equals the one-softmax absorbed form under
the same causal mask, for block sizes that divide the lengths and ones that do not (padded
queries and keys), with queries at an offset into the cache (a chunked prefill)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.ops import attention as attn_ops
from k3_jax.ops.rope_pages import fold_pages


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


def _paged_case(b=3, h=3, r=16, p=8, page=4, m=6, n_pages=24, seed=1):
  """Random queries and a shuffled page pool; row b's sequence lives in pages table[b]."""
  k = jax.random.split(jax.random.key(seed), 6)
  q_lat, q_rope = jax.random.normal(k[0], (b, h, r)), jax.random.normal(k[1], (b, h, p))
  pool_c = jax.random.normal(k[2], (n_pages, page, r))
  pool_r = jax.random.normal(k[3], (n_pages, page, p))
  table = jax.random.permutation(k[4], n_pages)[:b * m].reshape(b, m).astype(jnp.int32)
  new_c, new_r = jax.random.normal(k[5], (b, r)), jax.random.normal(k[5], (b, p)) * 0.5
  return q_lat, q_rope, pool_c, pool_r, table, new_c, new_r


def _paged(q_lat, q_rope, pool_c, pool_r, table, new_c, new_r, pos, block, lanes=1):
  """Cached partials (over `lanes` interleaved column sets, as the page-axis shards take
  them) merged with the token's own, finished."""
  col_pos = jnp.arange(table.shape[1], dtype=jnp.int32) * pool_c.shape[1]
  folded = fold_pages(pool_r)                   # the pool's layout of the rope keys (4 a row)
  parts = [attn_ops.paged_decode_partial(q_lat, q_rope, pool_c, folded, table[:, i::lanes],
                                         col_pos[i::lanes], pos, 0.125, block=block)
           for i in range(lanes)]
  part = attn_ops.token_partial(q_lat, q_rope, new_c, new_r, 0.125)
  for c in parts:
    part = attn_ops.merge_partials(c, part)
  return attn_ops.finish_partial(part), part.m.max(0)


@pytest.mark.parametrize("block,lanes", [(1, 1), (3, 1), (4, 1), (1, 2), (2, 3)])
def test_paged_decode_equals_absorbed_over_the_sequence(block, lanes):
  """Attention over the pages in place + the token's own latents == the one-softmax absorbed
  form over the gathered sequence with the token written at its position."""
  q_lat, q_rope, pool_c, pool_r, table, new_c, new_r = case = _paged_case()
  pos = jnp.array([0, 9, 23], jnp.int32)              # nothing cached / mid-page / last slot
  got, got_max = jax.jit(lambda *a: _paged(*a, pos, block, lanes))(*case)
  b, m, page = table.shape[0], table.shape[1], pool_c.shape[1]
  rows = jnp.arange(b)
  c_all = pool_c[table].reshape(b, m * page, -1).at[rows, pos].set(new_c)
  r_all = pool_r[table].reshape(b, m * page, -1).at[rows, pos].set(new_r)
  mask = attn_ops.causal_mask(pos[:, None], jnp.broadcast_to(jnp.arange(m * page), (b, m * page)))
  want, want_max = attn_ops.absorbed_attention(q_lat[:, None], q_rope[:, None], c_all, r_all,
                                               0.125, mask)
  np.testing.assert_allclose(got, want[:, 0], rtol=0, atol=2e-6)
  np.testing.assert_allclose(got_max, want_max, rtol=0, atol=2e-6)


def test_paged_decode_rows_are_independent_bitwise():
  """A row's output is bitwise the same alone, beside longer rows (more loop steps), and
  with more table columns past its position (a wider page bucket): batch invariance."""
  q_lat, q_rope, pool_c, pool_r, table, new_c, new_r = _paged_case(m=8, n_pages=30)
  run = jax.jit(lambda *a: _paged(*a[:-1], a[-1], 1)[0])
  pos = jnp.array([5, 31, 17], jnp.int32)
  together = run(q_lat, q_rope, pool_c, pool_r, table, new_c, new_r, pos)
  for i in range(3):
    one = lambda a: a[i:i + 1]
    alone = run(*map(one, (q_lat, q_rope)), pool_c, pool_r, one(table), *map(one, (new_c, new_r)),
                pos[i:i + 1])
    np.testing.assert_array_equal(alone[0], together[i])
  narrow = run(q_lat[:1], q_rope[:1], pool_c, pool_r, table[:1, :2], new_c[:1], new_r[:1],
               pos[:1])
  np.testing.assert_array_equal(narrow[0], together[0])
