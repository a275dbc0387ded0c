"""The serving cache's memory: MLA latent pages from a pool, per-slot KDA states, and the
read-only KDA checkpoint slots of the prefix cache.

Device side, the cache is `K3Model.init_paged_cache(max_batch, num_pages, PAGE)`: a
ModelCache (k3_jax/cache.py) with per-sequence positions [B], a KDAState per KDA layer and a
PagedMLACache page pool per MLA layer; scanned layers carry a leading [R] repeat axis, so
their batch axis is 1 (k3_jax/stack.py). Page 0 is the null page: unused page-table entries
point at it, idle slots write into it, and no live position ever reads it.

Host side, `PagePool` hands out page ids with reference counts (a page shared by the prefix
cache and the requests that hit it is freed when the last holder lets go).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from k3_jax.cache import KDAState, ModelCache, PagedMLACache, replace
from k3_jax.config import SERVE_PAGE
from k3_jax.ops.kda import STATE_AXES
from k3_jax.stack import map_cache
from sharding import arrays, paged
from sharding.rules import logical_to_spec

PAGE = SERVE_PAGE    # tokens per MLA page = one prefix-cache hash block (architecture.md 9)
NULL_PAGE = 0


class PagePool:
  """Reference-counted page ids 1..num_pages-1 (0 is the null page), striped over `shards`.

  On a mesh the page pools split on their page axis into `shards` equal blocks of ids
  (shard s holds ids s N / shards ... (s + 1) N / shards - 1; paged_cache_shardings), and
  page-table column j of every sequence takes its page from shard j % shards, so a
  shard's own columns are the pages it holds and the decode attention reads them where
  they lie (sharding/paged.py). A page keeps its column for life: a prefix-cache page is
  shared at the column of its block, a copied page is copied into a page of the same
  column. One shard: the single-device pool (ids handed out lowest first)."""

  def __init__(self, num_pages: int, shards: int = 1):
    if num_pages < 2:
      raise ValueError(f"a page pool needs at least 2 pages (one is the null page), got {num_pages}")
    if shards < 1 or num_pages % shards:
      raise ValueError(f"num_pages={num_pages} does not split over {shards} page shards")
    self.num_pages, self.shards = num_pages, shards
    self.per_shard = num_pages // shards
    self.refs = np.zeros(num_pages, np.int32)
    self.refs[NULL_PAGE] = 1 << 30                  # never freed, never handed out
    self._free = [[p for p in range((s + 1) * self.per_shard - 1, s * self.per_shard - 1, -1)
                   if p != NULL_PAGE] for s in range(shards)]

  @property
  def free(self) -> int:
    return sum(len(f) for f in self._free)

  def shard_of(self, page: int) -> int:
    return page // self.per_shard

  def _need(self, n: int, start: int) -> np.ndarray:
    """Pages per shard that columns start .. start + n - 1 take."""
    return np.bincount(np.arange(start, start + n) % self.shards, minlength=self.shards)

  def ever_fits(self, n: int) -> bool:
    """Could n pages for columns 0 .. n - 1 come from the empty pool (the null page, on
    shard 0, is never handed out)?"""
    cap = [self.per_shard - (s == 0) for s in range(self.shards)]
    return all(k <= c for k, c in zip(self._need(n, 0), cap))

  def fits(self, n: int, start: int = 0) -> bool:
    """Could `alloc(n, start)` succeed now?"""
    return all(len(f) >= k for f, k in zip(self._free, self._need(n, start)))

  def alloc(self, n: int, start: int = 0) -> list[int] | None:
    """n fresh pages (refcount 1 each) for page-table columns start .. start + n - 1 (column
    j's from shard j % shards), or None (nothing taken) when a shard has too few free."""
    if not self.fits(n, start):
      return None
    out = [self._free[j % self.shards].pop() for j in range(start, start + n)]
    self.refs[out] = 1
    return out

  def incref(self, pages) -> None:
    for p in pages:
      assert self.refs[p] > 0, f"page {p} is not allocated"
      self.refs[p] += 1

  def decref(self, pages) -> None:
    for p in pages:
      assert self.refs[p] > 0, f"page {p} released twice"
      self.refs[p] -= 1
      if self.refs[p] == 0:
        self._free[self.shard_of(p)].append(p)


def page_shards(mesh) -> int:
  """Into how many blocks the page axis splits on `mesh` (1 without one)."""
  return 1 if mesh is None else math.prod(mesh.shape[a] for a in paged.page_axes(mesh))


def pool_pages(max_batch: int, pages_per_slot: int, extra: int = 0, shards: int = 1) -> int:
  """Pages in a pool for `max_batch` slots of `pages_per_slot` columns plus `extra` (the
  prefix cache's), striped over `shards` (PagePool): each shard holds its columns' pages of
  every slot, its share of the extra ones and one more (the null page on shard 0; the
  others keep the split even). One shard: 1 + max_batch * pages_per_slot + extra."""
  per = max_batch * -(-pages_per_slot // shards) + -(-extra // shards) + 1
  return per * shards


# ----- the cache pytree ---------------------------------------------------------------

def with_pages(cache: ModelCache, pos: jax.Array, table: jax.Array) -> ModelCache:
  """The model-call view: per-sequence positions [B] and the page table [B, M] in every MLA
  layer (broadcast over the repeat axis of the scanned units)."""
  def attach(e, axis):
    if not isinstance(e, PagedMLACache):
      return e
    return replace(e, page_table=jnp.broadcast_to(table, e.c_kv.shape[:axis] + table.shape))
  return map_cache(attach, cache, pos=pos)


def without_pages(cache: ModelCache) -> ModelCache:
  return map_cache(lambda e, axis: replace(e, page_table=None)
                   if isinstance(e, PagedMLACache) else e, cache)


def kda_states(cache: ModelCache) -> ModelCache:
  """The per-sequence part of the cache (KDA layers only; MLA entries and pos become None)."""
  return map_cache(lambda e, axis: e if isinstance(e, KDAState) else None, cache, pos=None)


def with_kda_states(cache: ModelCache, states: ModelCache) -> ModelCache:
  return map_cache(lambda e, s, axis: s if isinstance(e, KDAState) else e, cache, states)


def take_rows(states: ModelCache, rows: jax.Array) -> ModelCache:
  """states (kda_states layout) -> the same with only `rows` [n] of the batch axis."""
  return map_cache(lambda e, axis: jax.tree.map(lambda a: jnp.take(a, rows, axis=axis), e),
                   states)


def put_rows(states: ModelCache, rows: jax.Array, values: ModelCache) -> ModelCache:
  """states with batch rows `rows` [n] replaced by `values` (same layout, n rows); a row
  index past the batch writes nothing."""
  def put(a, v, axis):
    if axis == 0:
      return a.at[rows].set(v.astype(a.dtype), mode="drop")
    return a.at[:, rows].set(v.astype(a.dtype), mode="drop")
  return map_cache(lambda e, ve, axis: jax.tree.map(lambda a, v: put(a, v, axis), e, ve),
                   states, values)


def put_slots(states: ModelCache, slots: jax.Array, active: jax.Array,
              values: ModelCache) -> ModelCache:
  """states with slot slots[i] set to values' row i where active[i]; an idle row writes
  back what its slot holds, so a padding row that repeats a slot changes nothing (active
  rows' slots must be distinct). One in-place dynamic_update_slice a row: put_rows's
  dropping scatter lowers on XLA:CPU to a select over every slot's state (with a verify
  window's states recomputed into it: 6 x 0.13 ms of a k3_small batch-1 verify step)."""
  def put(a, new, axis):
    for i in range(slots.shape[0]):
      old = jax.lax.dynamic_index_in_dim(a, slots[i], axis)
      row = jnp.where(active[i], jax.lax.index_in_dim(new, i, axis).astype(a.dtype), old)
      a = jax.lax.dynamic_update_index_in_dim(a, row, slots[i], axis)
    return a
  return map_cache(lambda e, ve, axis: jax.tree.map(lambda a, v: put(a, v, axis), e, ve),
                   states, values)


def zeros_rows(states: ModelCache, n: int) -> ModelCache:
  """A zero state for n rows (a fresh sequence: S = 0, empty conv windows)."""
  def z(a, axis):
    shape = list(a.shape)
    shape[axis] = n
    return jnp.zeros(shape, a.dtype)
  return map_cache(lambda e, axis: jax.tree.map(lambda a: z(a, axis), e), states)


def paged_cache_shardings(cache: ModelCache, mesh) -> ModelCache:
  """Shardings of the serving (paged) cache: KDA states on their batch axis, and a state's
  K dimension over the mesh axes the batch cannot use (a decode batch of 8 on 64 chips
  would otherwise hold every state on every chip, read and written whole each step; the
  decode's sums over K become all-reduces of [B, H, V], ops/kda.decode_step); each MLA page
  pool [(R,) N, P, X] split on its page axis over every mesh axis (N a multiple of the
  mesh size); the per-slot positions on the batch."""
  axes = paged.page_axes(mesh) or None

  def one(e, axis):
    if isinstance(e, KDAState):       # the state's K over the axes batch and heads leave
      names = (None,) * axis + STATE_AXES
      windows = arrays.batch_shardings(e, mesh, axis)
      return replace(windows, state=NamedSharding(
          mesh, logical_to_spec(e.state.shape, names, mesh)))
    if not isinstance(e, PagedMLACache):
      return arrays.batch_shardings(e, mesh, axis)
    spec = lambda a: NamedSharding(mesh, PartitionSpec(*(axes if i == axis else None
                                                          for i in range(a.ndim))))
    return PagedMLACache(c_kv=spec(e.c_kv), k_r=spec(e.k_r), page_table=None)
  return map_cache(one, cache, pos=arrays.batch_shardings(cache.pos, mesh, 0))


def tree_bytes(tree, rows: int = 1, batch: int | None = None) -> int:
  """Bytes of `tree`, or of `rows` of its batch rows when it has `batch` of them."""
  total = arrays.tree_bytes(tree)
  return total if batch is None else total * rows // batch


__all__ = ["PAGE", "NULL_PAGE", "PagePool", "page_shards", "pool_pages", "with_pages",
           "without_pages", "kda_states", "with_kda_states", "take_rows", "put_rows", "put_slots",
           "zeros_rows", "paged_cache_shardings"]
