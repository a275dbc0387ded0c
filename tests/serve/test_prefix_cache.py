"""PrefixCache bookkeeping on its own (no model): the cases the soak benchmark found."""

from k3_jax.serve.kv_pages import PagePool
from k3_jax.serve.prefix_cache import PrefixCache


def test_registering_a_child_under_a_full_budget_keeps_its_parent():
  # Budget: one page. The parent is the only evictable entry when its child registers;
  # room-making must not evict the parent it is about to hang the child on.
  pool = PagePool(8)
  cache = PrefixCache(pool, num_ckpt_slots=2, budget_bytes=100, page_bytes=100, ckpt_bytes=10)
  a, b = pool.alloc(2)
  assert cache.register_block(b"A", None, a, step=1)
  pool.decref([a])                          # the request that computed A has finished
  assert not cache.register_block(b"B", b"A", b, step=2)    # no room: skipped, not a crash
  assert set(cache.entries) == {b"A"} and cache.entries[b"A"].children == 0
  # with room, the child registers under its parent
  cache.budget = 200
  assert cache.register_block(b"B", b"A", b, step=2)
  assert cache.entries[b"A"].children == 1 and cache.entries[b"B"].parent == b"A"


def test_finer_unit_blocks_share_their_page():
  # U = 128: four blocks per 512-token page. The cache holds one reference per page and
  # frees the page with its last block; a hit inside a page names the page to copy from.
  pool = PagePool(8)
  cache = PrefixCache(pool, num_ckpt_slots=4, budget_bytes=1000, page_bytes=100,
                      ckpt_bytes=10, match_tokens=128)
  a, b = pool.alloc(2)
  hs = [bytes([i]) for i in range(6)]                 # blocks 0-3 on page a, 4-5 on page b
  for i, h in enumerate(hs):
    assert cache.register_block(h, hs[i - 1] if i else None, a if i < 4 else b, step=1)
  assert pool.refs[a] == pool.refs[b] == 2 and cache.used == 200
  assert cache.alloc_checkpoint(hs[2]) is not None and cache.alloc_checkpoint(hs[5]) is not None
  hit = cache.lookup(hs, 6, step=2)                   # 768 tokens: page a whole, b copied
  assert (hit.blocks, hit.tokens, hit.pages, hit.copy_src) == (6, 768, [a], b)
  assert pool.refs[a] == pool.refs[b] == 3
  pool.decref([a, b, a, b])                           # the hit and the owner let go
  cache.unpin_ckpt(hit.ckpt)
  short = cache.lookup(hs, 4, step=2)                 # 384 tokens: nothing whole, a copied
  assert (short.tokens, short.pages, short.copy_src) == (384, [], a)
  pool.decref([a])
  cache.unpin_ckpt(short.ckpt)
  assert cache._evict_one() and cache._evict_one()    # blocks 5, 4 (leaves first): page b
  assert b not in cache.page_entries and pool.refs[b] == 0 and cache.used == 100 + 10
  assert pool.refs[a] == 1                             # still cached by blocks 0-3
  while cache._evict_one():
    pass
  assert not cache.entries and pool.free == 7 and cache.used == 0


def test_striped_pool_gives_each_column_a_page_of_its_shard():
  # 4 shards of 4 ids (shard s: 4s .. 4s + 3; the null page 0 on shard 0): column j's page
  # comes from shard j % 4, freed pages go back to their shard, and an allocation that one
  # shard cannot serve takes nothing even when the pool as a whole has pages left.
  pool = PagePool(16, shards=4)
  assert pool.free == 15 and [pool.shard_of(p) for p in (0, 3, 4, 15)] == [0, 0, 1, 3]
  a = pool.alloc(6)                                   # columns 0-5
  assert [pool.shard_of(p) for p in a] == [0, 1, 2, 3, 0, 1]
  assert len(set(a)) == 6 and 0 not in a
  b = pool.alloc(3, start=2)                          # a fork's columns 2-4
  assert [pool.shard_of(p) for p in b] == [2, 3, 0]
  assert not pool.fits(1, start=0) and pool.alloc(1) is None    # shard 0 is empty
  assert pool.free == 6 and pool.fits(2, start=1)
  pool.decref(a[:1])
  assert pool.fits(1) and pool.alloc(1) == a[:1]      # back on shard 0, at column 0 again
  one = PagePool(8)                                   # one shard: ids from the lowest
  assert one.alloc(3) == [1, 2, 3] and one.alloc(2, start=5) == [4, 5]


def test_pool_pages_leave_every_shard_its_columns():
  from k3_jax.serve.kv_pages import pool_pages
  assert pool_pages(2, 4, 3) == 1 + 2 * 4 + 3         # one shard: as before striping
  n = pool_pages(2, 4, 3, shards=8)                   # 4 columns over 8 shards
  pool = PagePool(n, shards=8)
  assert pool.alloc(4) and pool.alloc(4) and pool.alloc(3, start=4)   # 2 slots + extra
  assert pool_pages(8, 2048, 0, 64) == 16448          # the k3 v5p-128 decode compile
