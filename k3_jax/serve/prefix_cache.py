"""The KDA-aware prefix cache (docs/architecture.md section 9): host-side bookkeeping.

- Prompts are cut into hash blocks of `match_tokens` tokens (the prefix match grid U, a power of
  two dividing the 512-token MLA page; 512 by default) with chained hashes (block i's hash
  covers every token before its end, and the content of the images whose placeholders it
  holds), so equal hashes mean equal prefixes.
- A cached block names the MLA page holding its latents: the 512 / U blocks of one page
  share it (the cache holds one reference per page, dropped with the page's last block).
  The page of block i holds valid latents for every position of that page up to the end
  of block i. The page id indexes every MLA layer's pool, so a block is present in all MLA
  layers or in none.
- A boundary (the end of a block) may carry a KDA checkpoint: one slot index into the
  checkpoint arrays of every KDA layer, holding the state after exactly U*n tokens.
  Checkpoints are read-only; a hit copies one into the request's own slot.
- Lookup: walk the chain while blocks are cached (skipping blocks registered in the current
  engine step), and return the longest boundary on it that has a checkpoint: the pages
  wholly before it (shared) and, when it falls inside a page, the page to copy that page's
  first part from (the request writes the rest into its own copy).
- Eviction: least recently used leaf entry (no cached successor) that no running request
  holds; it frees the checkpoint (and the page, with its last block) together, so a boundary
  is invalidated in all layers at once. Touching a chain marks its ancestors more recent
  than its descendants, so leaves go first.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from k3_jax.data import images as im
from k3_jax.serve.kv_pages import PAGE, PagePool


def block_hashes(tokens, block: int = PAGE, salts: dict[int, bytes] | None = None
                 ) -> list[bytes]:
  """Chained hashes of the full `block`-token blocks of `tokens`. salts: {block index: bytes}
  mixed into that block's hash (what the tokens alone do not say, see image_salts)."""
  arr = np.asarray(tokens, np.int64)
  out, prev = [], b"k3-prefix"
  for i in range(len(arr) // block):
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(arr[i * block:(i + 1) * block].tobytes())
    if salts and i in salts:
      h.update(salts[i])
    prev = h.digest()
    out.append(prev)
  return out


def image_salts(tokens, images: dict, placeholder_id: int, block: int = PAGE
                ) -> dict[int, bytes]:
  """{block index: content hashes of the images whose placeholders lie in that block}: the
  placeholder tokens of two different images of one size are identical, so without these a
  block (and, chained, everything after it) would match another image's KV and KDA state."""
  pos = np.flatnonzero(np.asarray(tokens) == placeholder_id)        # [M] placeholder positions
  owner = im.feature_images(images)                                 # [M] image of each
  digests = im.image_digests(images)
  blocks = pos // block
  return {int(b): b"".join(digests[i] for i in np.unique(owner[blocks == b]))
          for b in np.unique(blocks)}


@dataclasses.dataclass
class Entry:
  page: int
  parent: bytes | None
  ckpt: int | None = None        # checkpoint slot of the state after this block, if kept
  last_used: int = 0
  step: int = -1                 # engine step it was registered in
  children: int = 0


@dataclasses.dataclass
class Hit:
  blocks: int                    # hit length in blocks of `match_tokens` tokens
  tokens: int                    # = match_tokens * blocks
  pages: list[int]               # the MLA pages wholly inside the hit, in order (shared)
  copy_src: int | None           # the page whose first tokens % 512 latents the request
                                 # copies into a page of its own (None: the hit ends on a
                                 # page boundary); pinned until the caller releases it
  ckpt: int | None               # the checkpoint at the boundary (None when blocks == 0)


class PrefixCache:
  def __init__(self, pool: PagePool, num_ckpt_slots: int, budget_bytes: int,
               page_bytes: int, ckpt_bytes: int, match_tokens: int = PAGE):
    if not (1 <= match_tokens <= PAGE and PAGE % match_tokens == 0):
      raise ValueError(f"prefix match_tokens={match_tokens} must divide the page of {PAGE} "
                       "tokens")
    self.pool, self.match_tokens, self.per_page = pool, match_tokens, PAGE // match_tokens
    self.page_entries: dict[int, int] = {}     # page -> cached blocks naming it
    self.budget, self.page_bytes, self.ckpt_bytes = budget_bytes, page_bytes, ckpt_bytes
    self.entries: dict[bytes, Entry] = {}
    self._free_ckpt = list(range(num_ckpt_slots - 1, -1, -1))
    self.ckpt_pins: dict[int, int] = {}
    self.used = 0
    self.clock = 0
    self.queries = self.hits = 0            # in tokens, as vLLM counts them
    self.query_requests = self.hit_requests = 0
    self.evictions = 0
    self.spill = None      # spill(hash, entry, last block of its page): called on eviction
                           # (cache_tiers demotes the entry to the host / disk tiers)

  # ----- lookup ----------------------------------------------------------------
  def lookup(self, hashes: list[bytes], max_blocks: int, step: int) -> Hit:
    """The longest usable prefix among the first max_blocks blocks; pins it (its pages, and
    the page to copy from, get a reference for the request, its checkpoint a pin) before
    the caller allocates anything."""
    best, chain = 0, []
    for i, h in enumerate(hashes[:max_blocks]):
      e = self.entries.get(h)
      if e is None or e.step == step:      # never match what this step registered
        break
      chain.append(e)
      if e.ckpt is not None:
        best = i + 1
    tokens, k = best * self.match_tokens, self.per_page
    # a whole page is read from the page of its last block (valid over the whole page)
    pages = [chain[(p + 1) * k - 1].page for p in range(tokens // PAGE)]
    copy_src = chain[best - 1].page if tokens % PAGE else None
    ckpt = chain[best - 1].ckpt if best else None
    self.pool.incref(pages + ([copy_src] if copy_src is not None else []))
    if ckpt is not None:
      self.ckpt_pins[ckpt] = self.ckpt_pins.get(ckpt, 0) + 1
      self._touch(hashes[:best])
    return Hit(best, tokens, pages, copy_src, ckpt)

  def count(self, prompt_tokens: int, hit_tokens: int) -> None:
    self.queries += prompt_tokens
    self.hits += hit_tokens
    self.query_requests += 1
    self.hit_requests += hit_tokens > 0

  def unpin_ckpt(self, ckpt: int | None) -> None:
    if ckpt is None:
      return
    self.ckpt_pins[ckpt] -= 1
    if not self.ckpt_pins[ckpt]:
      del self.ckpt_pins[ckpt]

  def _touch(self, hashes) -> None:
    for h in reversed(hashes):            # ancestors end up more recent than descendants
      self.clock += 1
      self.entries[h].last_used = self.clock

  # ----- registration --------------------------------------------------------------
  def register_block(self, h: bytes, parent: bytes | None, page: int, step: int) -> bool:
    """Caches a freshly computed block whose latents lie in `page` (the cache takes a
    reference on the page with its first block)."""
    if h in self.entries:
      return True
    if parent is not None and parent not in self.entries:
      return False                         # its chain was evicted: unreachable, skip
    if parent is not None:                 # counted first: room-making must not evict it
      self.entries[parent].children += 1
    new_page = page not in self.page_entries
    if new_page and not self._make_room(self.page_bytes):
      if parent is not None:
        self.entries[parent].children -= 1
      return False
    if new_page:
      self.pool.incref([page])
      self.page_entries[page] = 0
      self.used += self.page_bytes
    self.page_entries[page] += 1
    self.entries[h] = Entry(page, parent, step=step)
    self._touch([h])
    return True

  def want_checkpoint(self, h: bytes) -> bool:
    e = self.entries.get(h)
    return e is not None and e.ckpt is None

  def alloc_checkpoint(self, h: bytes) -> int | None:
    """A fresh checkpoint slot for boundary h (registered block without one), or None."""
    if not self.want_checkpoint(h):
      return None
    e = self.entries[h]
    e.last_used = self.clock = self.clock + 1
    self.pool.incref([e.page])                   # h itself must survive the room-making
    ok = self._make_room(self.ckpt_bytes) and bool(self._free_ckpt or self._evict_one(ckpt=True))
    self.pool.decref([e.page])
    if not ok or not self._free_ckpt:
      return None
    slot = self._free_ckpt.pop()
    self.entries[h].ckpt = slot
    self.used += self.ckpt_bytes
    return slot

  # ----- eviction --------------------------------------------------------------------
  def _evictable(self, e: Entry, ckpt: bool) -> bool:
    return (e.children == 0 and self.pool.refs[e.page] == 1 and
            (e.ckpt is None or e.ckpt not in self.ckpt_pins) and (not ckpt or e.ckpt is not None))

  def _evict_one(self, ckpt: bool = False) -> bool:
    cands = [(e.last_used, h) for h, e in self.entries.items() if self._evictable(e, ckpt)]
    if not cands:
      return False
    _, h = min(cands)
    if self.spill is not None:
      self.spill(h, self.entries[h], self.page_entries[self.entries[h].page] == 1)
    e = self.entries.pop(h)
    if e.parent is not None and e.parent in self.entries:
      self.entries[e.parent].children -= 1
    self.page_entries[e.page] -= 1
    if not self.page_entries[e.page]:            # the page's last block: free the page
      del self.page_entries[e.page]
      self.pool.decref([e.page])
      self.used -= self.page_bytes
    if e.ckpt is not None:
      self._free_ckpt.append(e.ckpt)
      self.used -= self.ckpt_bytes
    self.evictions += 1
    return True

  def _make_room(self, nbytes: int) -> bool:
    while self.used + nbytes > self.budget:
      if not self._evict_one():
        return False
    return True

  def free_pages(self, n: int, start: int = 0) -> bool:
    """Evicts until the pool can allocate n pages for columns start .. start + n - 1
    (PagePool.fits); False if it cannot."""
    while not self.pool.fits(n, start):
      if not self._evict_one():
        return False
    return True

  def stats(self) -> dict:
    return {"queries": self.queries, "hits": self.hits, "query_requests": self.query_requests,
            "hit_requests": self.hit_requests, "blocks": len(self.entries),
            "pages": len(self.page_entries),
            "checkpoints": sum(e.ckpt is not None for e in self.entries.values()),
            "bytes": self.used, "budget_bytes": self.budget, "evictions": self.evictions}


__all__ = ["block_hashes", "image_salts", "PrefixCache", "Hit", "Entry"]
