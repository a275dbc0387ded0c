"""Paged decode attention over page pools split on their page axis (serving on a mesh).

The serving cache's MLA pools [(U,) N, P, X] split their page axis N into equal blocks over
`page_axes(mesh)` (k3_jax/serve/kv_pages.py paged_cache_shardings), and the page pool
stripes every sequence's pages over those blocks: page-table column j holds a page of
shard j % n (PagePool). So under `shard_map` each shard attends over its own columns,
reading the pages where they lie, and the softmax partials (running max, sum, weighted
latents) of the n shards combine exactly as flash decoding combines its splits: a pmax of
the maxima, then psums of the rescaled sums and latents. What crosses the chips per layer
is [B, H] x 2 + [B, H, R] floats, not the pages.

That split is by length (decode context parallelism): every shard holds part of every
sequence, which suits a batch smaller than the mesh. A batch that fills the mesh is split
by sequence instead (`split="slot"`): slot b's pages all lie in shard b // (B / n) (the
pool's ids for that shard), the queries, page table and positions are split on the batch,
each shard attends its own slots over all their columns, and nothing is combined across
shards: no [B, H, R] all-reduce per layer, no replicated queries.
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


# How the pages of a sequence lie over the page shards: "column" (striped by page-table
# column, j % n: split by length) or "slot" (every page of slot b on shard b // (B / n)).
PAGE_SPLITS = ("column", "slot")


def paged_attention(mesh: Mesh, q_latent, q_rope, pool_c, pool_r, unit, table, pos, scale,
                    block, kernel=False, split="column"):
  """`k3_jax.layers.mla.paged_attention` on `mesh`: each shard over its own table columns
  (j % n == its index along page_axes), then the partials combined over the shards.
  q_latent [B, H, R], q_rope [B, H, P], table [B, M], pos [B] replicated; pools split on
  their page axis. -> the attention.Partial of all cached positions < pos, replicated.
  split="slot": each shard attends its own slots instead (`slot_paged_attention`)."""
  if split == "slot":
    return slot_paged_attention(mesh, q_latent, q_rope, pool_c, pool_r, unit, table, pos,
                                scale, block, kernel)
  if split != "column":
    raise ValueError(f"split={split!r}: expected one of {PAGE_SPLITS}")
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


def slot_paged_attention(mesh: Mesh, q_latent, q_rope, pool_c, pool_r, unit, table, pos, scale,
                         block, kernel=False):
  """The paged decode attention split by sequence: slot b's pages are ids of shard
  b // (B / n) (n = the page shards), every array with a batch axis is split on it, each
  shard attends its B / n slots over all their columns with its local page ids, and the
  result stays split on the batch (no combine). B must be a multiple of n."""
  axes = page_axes(mesh)
  n = 1
  for a in axes:
    n *= mesh.shape[a]
  b = table.shape[0]
  if b % n:
    raise ValueError(f"pages split by slot need a batch divisible by the {n} page shards "
                     f"(mesh axes {axes}); got {b} slots: use split='column'")
  lead = () if unit is None else (None,)
  rows = P(axes)
  body = functools.partial(_local_slots, scale=scale, block=block, axes=axes,
                           stacked=unit is not None, kernel=kernel)
  args = (q_latent, q_rope, pool_c, pool_r, table, pos) + (() if unit is None else (unit,))
  specs = ((rows, rows, P(*lead, axes, None, None), P(*lead, axes, None, None), rows, rows)
           + (() if unit is None else (P(),)))
  fn = jax.shard_map(body, mesh=mesh, in_specs=specs,
                     out_specs=attn_ops.Partial(rows, rows, rows), check_vma=False)
  return fn(*args)


def _local_slots(q_latent, q_rope, pool_c, pool_r, table, pos, *unit, scale, block, axes,
                 stacked, kernel):
  """One shard's slots over every column: global page ids -> this shard's local ids (the
  null page 0 of a column no query sees may be another shard's: clipped, and masked)."""
  s = jax.lax.axis_index(axes)
  local, page = pool_c.shape[-3], pool_c.shape[-2]
  ids = jnp.clip(table - s * local, 0, local - 1)
  col_pos = jnp.arange(table.shape[1], dtype=jnp.int32) * page
  return attn_ops.paged_partial(q_latent, q_rope, pool_c, pool_r, ids, col_pos, pos, scale,
                                unit[0] if stacked else None, block, kernel)


def parallel_ops(mesh: Mesh, split: str = "column") -> dict:
  """The paged decode attention when the page axis splits (a mesh of several devices),
  with the pages laid out by `split` (PAGE_SPLITS)."""
  if split not in PAGE_SPLITS:
    raise ValueError(f"page split {split!r}: expected one of {PAGE_SPLITS}")
  if not page_axes(mesh):
    return {}
  return {"paged_attention": functools.partial(paged_attention, mesh, split=split)}


__all__ = ["PAGE_SPLITS", "page_axes", "paged_attention", "slot_paged_attention",
           "parallel_ops"]
