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
