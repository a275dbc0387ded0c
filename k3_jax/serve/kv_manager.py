"""The KV manager: the one owner of the serving cache's host-side bookkeeping.

It holds the page pool (kv_pages.PagePool), the prefix cache's entries and KDA checkpoint
slots (prefix_cache.PrefixCache) and every slot's page-table row, and the engine reaches
them only through these verbs:

    acquire(slot, hashes, tokens, need, ...)   a sequence joins: the prefix-cache hit on its
                   tokens (pinned), fresh pages for the rest of `need` positions; or None
                   (nothing taken) when the pool cannot hold it now
    settle(got)    the hit's device copies are done: its copy source and checkpoint unpinned
    fork(src, dst, full, need)   another sample of src's prompt: src's first `full` pages
                   shared, fresh ones for the rest
    grow(slot, need)   pages for positions < need (a decoding sequence crossing a page
                   boundary); False when the pool has none left (the engine then preempts)
    register(...)  what a prefill step wrote: the prompt's finished blocks join the prefix
                   cache, and the checkpoint slot to save the KDA state into, if one is kept
    release(slot)  the sequence's pages back (cached blocks stay with the prefix cache);
                   preempt(slot) the same when the pool ran out (counted)

Pages are handed out as a sequence grows (its prompt's pages and the first generated
position's at `acquire`, one more each time decoding crosses a page boundary), so the
pool's size is a memory budget (`pool_size`), not max_batch x max_len. The prefix cache
never allocates: it keeps references to pages requests wrote, and its unpinned entries are
evicted whenever the pool needs room.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from k3_jax.serve.kv_pages import PAGE, PagePool
from k3_jax.serve.prefix_cache import PrefixCache

CPU_KV_CACHE_BYTES = 1 << 30     # the pool's budget where the device reports no memory (CPU)
KV_CACHE_FRACTION = 0.8          # elsewhere: this share of the memory free after the weights


@dataclasses.dataclass
class Acquired:
  """What `acquire` gave a sequence."""
  pages: list[int]               # its page-table row: the hit's shared pages, then fresh ones
  hit_tokens: int                # prompt tokens served from the prefix cache
  copy_src: int | None           # page whose first hit_tokens % PAGE latents to copy into
                                 # pages[hit_tokens // PAGE] (pinned until `settle`)
  ckpt: int | None               # KDA checkpoint slot to load (pinned until `settle`)


def pool_size(budget_bytes: int, page_bytes: int, shards: int, cap: int) -> int:
  """Pages (the null page included) that `budget_bytes` of MLA pages hold, rounded down to
  a multiple of `shards` and at most `cap` (more could never be used); ValueError when the
  budget holds fewer than two pages."""
  n = min(budget_bytes // max(page_bytes, 1), cap) // shards * shards
  if n < max(2, shards):
    raise ValueError(
        f"kv_cache_bytes={budget_bytes} holds {budget_bytes // max(page_bytes, 1)} pages of "
        f"{PAGE} tokens ({page_bytes} bytes each over the MLA layers); the pool needs at "
        f"least {max(2, shards)} (one is the null page): raise it to "
        f">= {max(2, shards) * page_bytes}")
  return n


def auto_budget(devices, fixed_bytes: int, shards: int) -> tuple[int, str, bool]:
  """The default kv_cache_bytes, how it was chosen, and whether it was measured:
  KV_CACHE_FRACTION of what the first device has free (its limit less what is in use: the
  weights, already placed, and `fixed_bytes` more the engine will allocate per device),
  times the `shards` devices the pool splits over; CPU_KV_CACHE_BYTES (not measured: the
  same on every process) where the device reports no memory."""
  stats = None
  try:
    stats = devices[0].memory_stats()
  except Exception:         # a backend without memory statistics
    stats = None
  if not stats or not stats.get("bytes_limit"):
    return CPU_KV_CACHE_BYTES, "the fixed default of a device without memory statistics", False
  free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) - fixed_bytes
  if free <= 0:
    raise ValueError(f"no device memory left for the KV cache ({stats['bytes_limit']} bytes, "
                     f"{stats.get('bytes_in_use', 0)} in use): give --kv_cache_bytes")
  return (int(KV_CACHE_FRACTION * free) * shards,
          f"{KV_CACHE_FRACTION:.0%} of the {free / 2**30:.2f} GiB free per device after weights",
          True)


class KVManager:
  def __init__(self, num_pages: int, shards: int, max_batch: int, pages_per_slot: int,
               prefix: dict | None = None):
    """prefix: PrefixCache's settings (num_ckpt_slots, budget_bytes, page_bytes, ckpt_bytes,
    match_tokens), or None for no prefix cache."""
    self.pool = PagePool(num_pages, shards)
    self.prefix = None if prefix is None else PrefixCache(self.pool, **prefix)
    self.pages_per_slot = pages_per_slot
    self.tables = np.zeros((max_batch, pages_per_slot), np.int32)    # unused columns: null
    self.held: list[list[int]] = [[] for _ in range(max_batch)]       # each slot's pages
    self.preemptions = 0
    self.tiers = None      # cache_tiers.CacheTiers: host / disk tiers behind the prefix cache

  # ----- capacity ----------------------------------------------------------------------
  @property
  def num_pages(self) -> int:
    return self.pool.num_pages

  def ever_fits(self, tokens: int) -> bool:
    """Could one sequence of `tokens` positions hold its pages in the empty pool?"""
    return self.pool.ever_fits(math.ceil(tokens / PAGE))

  def _take(self, n: int, start: int) -> list[int] | None:
    """n fresh pages for columns start.., evicting unpinned prefix entries if needed."""
    if n <= 0:
      return []
    if not self.pool.fits(n, start) and not (
        self.prefix is not None and self.prefix.free_pages(n, start)):
      return None
    return self.pool.alloc(n, start)

  def _seat(self, slot: int, pages: list[int]) -> None:
    self.held[slot] = pages
    self.tables[slot] = 0
    self.tables[slot, :len(pages)] = pages

  # ----- verbs ---------------------------------------------------------------------------
  def acquire(self, slot: int, hashes: list[bytes], tokens: int, need: int, step: int,
              use_prefix: bool = True) -> Acquired | None:
    """Pages for a sequence of `tokens` prompt tokens that will hold `need` positions
    (prefix-cache hit first, leaving at least one token to run), seated at `slot`; None
    (every pin rolled back) when the pool cannot give them now."""
    hit_pages, copy_src, ckpt, hit_tokens = [], None, None, 0
    promoted = {}
    if self.tiers is not None and use_prefix:     # lower-tier blocks extending the hit
      promoted = self.tiers.promote(hashes, (tokens - 1) // self.prefix.match_tokens, step)
      if promoted is None:                        # its blocks are still being read from disk
        return None
    if self.prefix is not None and use_prefix:
      hit = self.prefix.lookup(hashes, (tokens - 1) // self.prefix.match_tokens, step)  # pins
      hit_pages, copy_src, ckpt, hit_tokens = hit.pages, hit.copy_src, hit.ckpt, hit.tokens
    fresh = self._take(math.ceil(need / PAGE) - len(hit_pages), len(hit_pages))
    if fresh is None:
      self.pool.decref(hit_pages + ([copy_src] if copy_src is not None else []))
      if self.prefix is not None:
        self.prefix.unpin_ckpt(ckpt)
      return None
    if self.prefix is not None and use_prefix:
      self.prefix.count(tokens, hit_tokens)
      if self.tiers is not None:
        self.tiers.counted(hit_tokens // self.prefix.match_tokens, promoted)
    self._seat(slot, hit_pages + fresh)
    return Acquired(hit_pages + fresh, hit_tokens, copy_src, ckpt)

  def settle(self, got: Acquired) -> None:
    if got.copy_src is not None:
      self.pool.decref([got.copy_src])
    if self.prefix is not None:
      self.prefix.unpin_ckpt(got.ckpt)

  def fork(self, src: int, dst: int, full: int, need: int) -> list[int] | None:
    """Seats `dst` on src's first `full` pages (shared) and fresh pages for the rest of
    `need` positions; None (nothing taken) when the pool cannot give them."""
    fresh = self._take(math.ceil(need / PAGE) - full, full)
    if fresh is None:
      return None
    shared = self.held[src][:full]
    self.pool.incref(shared)
    self._seat(dst, shared + fresh)
    return fresh

  def grow(self, slot: int, need: int) -> bool:
    """Pages for positions < need at `slot` (one more page as decoding crosses a page
    boundary); False (nothing taken) when the pool has none left."""
    have = self.held[slot]
    more = min(math.ceil(need / PAGE), self.pages_per_slot) - len(have)
    fresh = self._take(more, len(have))
    if fresh is None:
      return False
    if fresh:
      self._seat(slot, have + fresh)
    return True

  def register(self, slot: int, hashes: list[bytes], registered: int, upto: int, step: int,
               keep_ckpt_at: int | None, state_rows=None) -> tuple[int, int | None]:
    """The blocks registered..upto/match_tokens of the sequence at `slot` (hashes: its blocks')
    handed to the prefix cache -> (blocks now registered, a checkpoint slot to save the
    KDA state into when `keep_ckpt_at` (a position on the match grid) is wholly registered).
    With the cache tiers, blocks the device cache cannot take are written around it to the
    lower tiers (and counted as registered), the checkpoint too: the KDA state of the slot
    now, or row `slot` of `state_rows` when given."""
    u, pages = self.prefix.match_tokens, self.held[slot]
    page_of = lambda j: pages[j * u // PAGE]                # block j's page
    for i in range(registered, upto // u):
      if not self.prefix.register_block(hashes[i], hashes[i - 1] if i else None,
                                        page_of(i), step):
        if self.tiers is not None:                # cache tiers: write-around
          registered = self.tiers.write_around(hashes, i, upto // u, page_of)
        break
      registered = i + 1
    if keep_ckpt_at is None or registered * u < keep_ckpt_at:
      return registered, None
    b = keep_ckpt_at // u - 1
    if hashes[b] not in self.prefix.entries and self.tiers is not None:
      self.tiers.write_around_ckpt(hashes[b], hashes[b - 1] if b else None,
                                   lambda: page_of(b),
                                   lambda: self.tiers.io.read_state(slot, state_rows))
      return registered, None
    return registered, self.prefix.alloc_checkpoint(hashes[b])

  def release(self, slot: int) -> None:
    self.pool.decref(self.held[slot])
    self._seat(slot, [])

  def preempt(self, slot: int) -> None:
    """release, for a sequence taken off its slot because the pool ran out (counted)."""
    self.release(slot)
    self.preemptions += 1

  # ----- reading -------------------------------------------------------------------------
  def counts(self) -> dict:
    refs = self.pool.refs
    entries = self.prefix.entries.values() if self.prefix is not None else ()
    return {"used_pages": self.pool.num_pages - 1 - self.pool.free,
            "free_pages": self.pool.free,
            "cached_pages": len(self.prefix.page_entries) if self.prefix is not None else 0,
            "pinned_blocks": sum(1 for e in entries if refs[e.page] > 1),   # blocks of U
            "pinned_checkpoints": (sum(self.prefix.ckpt_pins.values())
                                   if self.prefix is not None else 0),
            "preemptions": self.preemptions}


__all__ = ["KVManager", "Acquired", "pool_size", "auto_budget",
           "CPU_KV_CACHE_BYTES", "KV_CACHE_FRACTION"]
