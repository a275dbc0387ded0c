"""The serving cache's memory: MLA latent pages from a pool, per-slot KDA states, and the
read-only KDA checkpoint slots of the prefix cache.

Device side, the cache is `K3Model.init_paged_cache(max_batch, num_pages, PAGE)`:
{'pos': [B], 'prefix': [...], 'units': [...], 'suffix': [...]} where each KDA layer holds
{'state': [B, H, K, V] f32, 'conv_q'/'conv_k'/'conv_v': [B, W-1, H*K]} and each MLA layer a
page pool {'c_kv': [N, P, R], 'k_r': [N, P, Pr]}; scanned layers ('units') carry a leading
[R] repeat axis, so their batch axis is 1. Page 0 is the null page: unused page-table entries
point at it, idle slots write into it, and no live position ever reads it.

Host side, `PagePool` hands out page ids with reference counts (a page shared by the prefix
cache and the requests that hit it is freed when the last holder lets go).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sharding import aot

PAGE = 512          # tokens per MLA page = one prefix-cache hash block (K3_SPEC section 9)
NULL_PAGE = 0


class PagePool:
  """Reference-counted page ids 1..num_pages-1 (0 is the null page)."""

  def __init__(self, num_pages: int):
    if num_pages < 2:
      raise ValueError(f"a page pool needs at least 2 pages (one is the null page), got {num_pages}")
    self.num_pages = num_pages
    self.refs = np.zeros(num_pages, np.int32)
    self.refs[NULL_PAGE] = 1 << 30                  # never freed, never handed out
    self._free = list(range(num_pages - 1, 0, -1))

  @property
  def free(self) -> int:
    return len(self._free)

  def alloc(self, n: int) -> list[int] | None:
    """n fresh pages (refcount 1 each), or None (nothing taken) when fewer are free."""
    if n > len(self._free):
      return None
    out = [self._free.pop() for _ in range(n)]
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
        self._free.append(p)


# ----- the cache pytree ---------------------------------------------------------------

def _is_mla(entry: dict) -> bool:
  return "c_kv" in entry


def with_pages(cache: dict, pos: jax.Array, table: jax.Array) -> dict:
  """The model-call view: per-sequence positions [B] and the page table [B, M] in every MLA
  layer (broadcast over the repeat axis of the scanned units)."""
  out = {"pos": pos}
  for name in ("prefix", "suffix"):
    out[name] = [{**e, "page_table": table} if _is_mla(e) else e for e in cache[name]]
  if "units" in cache:
    out["units"] = [
        {**e, "page_table": jnp.broadcast_to(table, (e["c_kv"].shape[0],) + table.shape)}
        if _is_mla(e) else e for e in cache["units"]]
  return out


def without_pages(cache: dict) -> dict:
  strip = lambda e: {k: v for k, v in e.items() if k != "page_table"}
  out = {"pos": cache["pos"]}
  for name in ("prefix", "suffix", "units"):
    if name in cache:
      out[name] = [strip(e) for e in cache[name]]
  return out


def kda_states(cache: dict) -> dict:
  """The per-sequence part of the cache (KDA layers only; MLA entries become None)."""
  out = {}
  for name in ("prefix", "suffix", "units"):
    if name in cache:
      out[name] = [None if _is_mla(e) else e for e in cache[name]]
  return out


def with_kda_states(cache: dict, states: dict) -> dict:
  out = dict(cache)
  for name in ("prefix", "suffix", "units"):
    if name in cache:
      out[name] = [e if _is_mla(e) else s for e, s in zip(cache[name], states[name])]
  return out


def _batch_axis(name: str) -> int:
  return 1 if name == "units" else 0


def take_rows(states: dict, rows: jax.Array) -> dict:
  """states (kda_states layout) -> the same with only `rows` [n] of the batch axis."""
  return {name: [None if e is None else jax.tree.map(
      lambda a: jnp.take(a, rows, axis=_batch_axis(name)), e) for e in lst]
      for name, lst in states.items()}


def put_rows(states: dict, rows: jax.Array, values: dict) -> dict:
  """states with batch rows `rows` [n] replaced by `values` (same layout, n rows)."""
  def put(name, a, v):
    if _batch_axis(name) == 0:
      return a.at[rows].set(v.astype(a.dtype))
    return a.at[:, rows].set(v.astype(a.dtype))
  return {name: [None if e is None else jax.tree.map(lambda a, v: put(name, a, v), e, ve)
                 for e, ve in zip(lst, values[name])]
          for name, lst in states.items()}


def select_rows(mask: jax.Array, new: dict, old: dict) -> dict:
  """Per batch row: new where mask [B] else old (keeps idle slots' states untouched)."""
  def sel(name, n, o):
    shape = [1] * n.ndim
    shape[_batch_axis(name)] = mask.shape[0]
    return jnp.where(mask.reshape(shape), n, o)
  return {name: [None if e is None else jax.tree.map(lambda n, o: sel(name, n, o), e, oe)
                 for e, oe in zip(lst, old[name])]
          for name, lst in new.items()}


def zeros_rows(states: dict, n: int) -> dict:
  """A zero state for n rows (a fresh sequence: S = 0, empty conv windows)."""
  def z(name, a):
    shape = list(a.shape)
    shape[_batch_axis(name)] = n
    return jnp.zeros(shape, a.dtype)
  return {name: [None if e is None else jax.tree.map(lambda a: z(name, a), e) for e in lst]
          for name, lst in states.items()}


def tree_bytes(tree, rows: int = 1, batch: int | None = None) -> int:
  """Bytes of `tree`, or of `rows` of its batch rows when it has `batch` of them."""
  total = aot.tree_bytes(tree)
  return total if batch is None else total * rows // batch


__all__ = ["PAGE", "NULL_PAGE", "PagePool", "with_pages", "without_pages", "kda_states",
           "with_kda_states", "take_rows", "put_rows", "select_rows", "zeros_rows"]
