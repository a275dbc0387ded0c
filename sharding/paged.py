"""Paged decode attention over page pools split on their page axis (serving on a mesh).

The serving cache's MLA pools [(U,) N, P, X] split their page axis N into equal blocks over
`page_axes(mesh)` (k3_jax/serve/kv_pages.py paged_cache_shardings), and the page pool
stripes every sequence's pages over those blocks: page-table column j holds a page of
shard j % n (PagePool). So under `shard_map` each shard attends over its own columns,
reading the pages where they lie, and the softmax partials (running max, sum, weighted
latents) of the n shards combine exactly as flash decoding combines its splits: a pmax of
the maxima, then psums of the rescaled sums and latents. What crosses the chips per layer
is [B, H] x 2 + [B, H, R] floats, not the pages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from k3_jax.ops import attention as attn_ops


def page_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes the page axis splits over (every axis of more than one device)."""
  return tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)


def paged_attention(mesh: Mesh, q_latent, q_rope, pool_c, pool_r, unit, table, pos, scale,
                    block, kernel=False):
  """`k3_jax.layers.mla.paged_attention` on `mesh`: each shard over its own table columns
  (j % n == its index along page_axes), then the partials combined over the shards.
  q_latent [B, H, R], q_rope [B, H, P], table [B, M], pos [B] replicated; pools split on
  their page axis. -> the attention.Partial of all cached positions < pos, replicated."""
  axes = page_axes(mesh)
  n = 1
  for a in axes:
    n *= mesh.shape[a]
  lead = () if unit is None else (None,)
  pool_spec = P(*lead, axes, None, None)
  body = functools.partial(_local, axes=axes, shards=n, scale=scale, block=block,
                           stacked=unit is not None, kernel=kernel)
  args = (q_latent, q_rope, pool_c, pool_r, table, pos) + (() if unit is None else (unit,))
  specs = (P(), P(), pool_spec, pool_spec, P(), P()) + (() if unit is None else (P(),))
  fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=attn_ops.Partial(P(), P(), P()),
                     check_vma=False)
  return fn(*args)


def _local(q_latent, q_rope, pool_c, pool_r, table, pos, *unit, axes, shards, scale, block,
           stacked, kernel):
  """One shard: the columns j = s, s + n, ... of the table, their pages as local ids."""
  s = jax.lax.axis_index(axes)
  b, m = table.shape
  local, page = pool_c.shape[-3], pool_c.shape[-2]
  cols = -(-m // shards)
  table = jnp.pad(table, ((0, 0), (0, cols * shards - m)))     # padded columns: no query's
  mine = jax.lax.dynamic_index_in_dim(table.reshape(b, cols, shards), s, 2, keepdims=False)
  ids = jnp.clip(mine - s * local, 0, local - 1)     # another shard's id: only where masked
  col_pos = (jnp.arange(cols, dtype=jnp.int32) * shards + s) * page
  part = attn_ops.paged_partial(q_latent, q_rope, pool_c, pool_r, ids, col_pos, pos, scale,
                                unit[0] if stacked else None, block, kernel)
  m_all = jax.lax.pmax(part.m, axes)
  keep = attn_ops.rescale(part.m, m_all)
  return attn_ops.Partial(m_all, jax.lax.psum(part.l * keep, axes),
                          jax.lax.psum(part.acc * keep[..., None], axes))


def parallel_ops(mesh: Mesh) -> dict:
  """The paged decode attention when the page axis splits (a mesh of several devices)."""
  if not page_axes(mesh):
    return {}
  return {"paged_attention": functools.partial(paged_attention, mesh)}


__all__ = ["page_axes", "paged_attention", "parallel_ops"]
