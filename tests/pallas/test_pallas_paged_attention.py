"""The Pallas paged decode attention (pallas_kernels/paged_attention.py, interpret mode on
CPU) against the plain-JAX `ops.attention.paged_decode_partial`, and its TPU lowering.

Tolerance: both sides compute in FP32 with the same online-softmax recurrence, one page a
step; they differ in the order of the matmul sums (XLA's dot vs the kernel's), a few
float32 roundings of values O(1): 2e-6 absolute on m, l and acc (measured ~5e-7)."""

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.ops import attention as attn_ops
from k3_jax.ops.rope_pages import fold_pages
from pallas_kernels.paged_attention import paged_decode_partial as kernel

B, H, R, PR, PAGE, N, M = 3, 8, 128, 64, 16, 12, 4


def _case(seed=0, stacked=False):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  lead = (2,) if stacked else ()
  q_lat = jax.random.normal(ks[0], (B, H, R))
  q_rope = jax.random.normal(ks[1], (B, H, PR))
  pool_c = jax.random.normal(ks[2], lead + (N, PAGE, R)).astype(jnp.bfloat16)
  pool_r = fold_pages(jax.random.normal(ks[3], lead + (N, PAGE, PR)).astype(jnp.bfloat16))
  table = jax.random.permutation(ks[4], N)[: B * M].reshape(B, M).astype(jnp.int32)
  return q_lat, q_rope, pool_c, pool_r, table


def test_kernel_matches_the_reference():
  """Rows with nothing cached, a partly seen page, and every column seen; a stacked pool
  read at a unit index; the table's columns at interleaved positions (a shard's view)."""
  pos = jnp.array([0, 21, M * PAGE], jnp.int32)
  for stacked in (False, True):
    q_lat, q_rope, pool_c, pool_r, table = _case(stacked=stacked)
    unit = jnp.int32(1) if stacked else None
    cols_all = [jnp.arange(M, dtype=jnp.int32) * PAGE,               # every column, in order
                (jnp.arange(M, dtype=jnp.int32) * 2 + 1) * PAGE]    # shard 1 of 2
    for cols in cols_all[:1 + stacked]:
      args = (q_lat, q_rope, pool_c, pool_r, table, cols, pos, 0.125, unit)
      want = attn_ops.paged_decode_partial(*args)
      got = kernel(*args, interpret=True)
      for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-6)
      assert np.all(np.isneginf(np.asarray(got[0][0])))          # row 0 saw nothing


def test_kernel_lowers_for_tpu():
  """Mosaic lowering and a v5p compile at K3's shapes (96 heads, 512 + 64 latent, 512-token
  pages, the rope keys folded two a row, stacked pools) inside shard_map, as
  sharding/paged.py calls it."""
  from benchmarks.mxfp4_gmm import AXIS as X, _mesh
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = _mesh("v5p")
  n = mesh.devices.size
  b, h, r, pr, page, pages, m, units = 8, 96, 512, 64, 512, 64, 8, 2

  def local(ql, qr, c, k, table, pos):
    cols = jnp.arange(m, dtype=jnp.int32) * page
    return kernel(ql, qr, c, k, table, cols, pos, 0.1, jnp.int32(1))

  rep, split = P(), P(None, X)
  fn = jax.shard_map(local, mesh=mesh, in_specs=(rep, rep, split, split, rep, rep),
                     out_specs=(P(X), P(X), P(X)), check_vma=False)
  sds = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
  text = jax.jit(fn).lower(sds((b, h, r), jnp.float32, rep), sds((b, h, pr), jnp.float32, rep),
                           sds((units, n * pages, page, r), jnp.bfloat16, split),
                           sds((units, n * pages, page // 2, 2 * pr), jnp.bfloat16, split),
                           sds((b, m), jnp.int32, rep), sds((b,), jnp.int32, rep)
                           ).compile().as_text()
  assert "paged_decode_attention" in text and '"cost_estimate"' in text
