"""The folded layout of the serving pools' rope keys (k3_jax/ops/rope_pages.py): exact
round trips, and a write lands where the unfolded view puts that position."""

import jax.numpy as jnp
import numpy as np

from k3_jax.ops import rope_pages


def test_fold_unfold_round_trip_and_shapes():
  assert rope_pages.fold(64, 512) == 2 and rope_pages.pool_shape(3, 512, 64) == (3, 256, 128)
  assert rope_pages.fold(4, 4) == 4 and rope_pages.fold(96, 512) == 1
  assert rope_pages.fold(128, 512) == 1
  keys = jnp.arange(2 * 3 * 8 * 4, dtype=jnp.float32).reshape(2, 3, 8, 4)
  folded = rope_pages.fold_pages(keys)                               # f = gcd(32, 8) = 8
  assert folded.shape == (2, 3, 1, 32)
  np.testing.assert_array_equal(rope_pages.unfold(folded, 4), keys)
  k3 = jnp.arange(512 * 64, dtype=jnp.float32).reshape(1, 512, 64)
  f3 = rope_pages.fold_pages(k3)
  np.testing.assert_array_equal(f3[0, 5, 64:], k3[0, 256 + 5])       # lane block 1: P/2 on
  np.testing.assert_array_equal(rope_pages.unfold(f3, 64), k3)


def test_write_matches_a_write_of_the_unfolded_view():
  rng = np.random.default_rng(0)
  pool = jnp.asarray(rng.normal(size=(2, 5, 16, 8)), jnp.float32)    # [U, N, P, Pr] logical
  unit = jnp.array([[0, 1, 1]])
  page = jnp.array([[4, 2, 0]])
  off = jnp.array([[15, 0, 9]])
  keys = jnp.asarray(rng.normal(size=(1, 3, 8)), jnp.float32)
  want = pool.at[unit, page, off].set(keys)
  got = rope_pages.write(rope_pages.fold_pages(pool), (unit, page), off, keys)
  assert got.shape == (2, 5, 1, 128)
  np.testing.assert_array_equal(rope_pages.unfold(got, 8), want)
  q = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
  fq = rope_pages.fold_queries(q, 4)                                 # [B, f, H, f Pr]
  np.testing.assert_array_equal(fq[:, 2, :, 16:24], q)
  assert float(jnp.abs(fq[:, 2, :, :16]).sum()) == 0.0
