"""The page pool sized by bytes (serve/kv_manager.py): pages handed out as sequences grow,
requests that wait or are preempted and resumed exactly, the budget's errors, and the
decode step's independence of the pool's size (no copy of a pool in its program)."""

import re
import types

import jax
import numpy as np
import pytest

from k3_jax import train
from k3_jax.config import ConfigError, ServeConfig, UserError
from k3_jax.model import create_model
from k3_jax.serve import kv_manager, steps
from k3_jax.serve.engine import Engine, SamplingParams
from k3_jax.serve.kv_manager import KVManager
from k3_jax.serve.kv_pages import PAGE
from k3_jax.serve.prefix_cache import block_hashes
from k3_jax.serve.requests import RequestError
from tests.serve.test_engine import tiny_serving_config


# ----- the manager alone (no device) ------------------------------------------------------

def test_pages_are_handed_out_as_a_sequence_grows():
  m = KVManager(num_pages=6, shards=1, max_batch=2, pages_per_slot=4)
  got = m.acquire(0, [], tokens=300, need=301, step=1)
  assert len(got.pages) == 1 and m.pool.free == 4
  assert m.grow(0, 512) and len(m.held[0]) == 1            # still inside page 0
  assert m.grow(0, 513) and len(m.held[0]) == 2            # position 512: a second page
  assert list(m.tables[0, :2]) == m.held[0] and m.tables[0, 2] == 0
  assert m.acquire(1, [], tokens=1000, need=1001, step=1) is not None     # 2 pages
  assert m.pool.free == 1
  assert m.grow(0, 1025) and not m.grow(1, 1025)           # the last page; then none
  assert len(m.held[1]) == 2                                # a failed grow takes nothing
  m.release(0)
  m.release(1)
  assert m.pool.free == 5 and not m.tables.any()


def test_acquire_waits_and_takes_nothing_when_the_pool_is_short():
  m = KVManager(num_pages=3, shards=1, max_batch=2, pages_per_slot=4)
  assert m.acquire(0, [], tokens=600, need=601, step=1) is not None        # both pages
  assert m.acquire(1, [], tokens=10, need=11, step=1) is None
  assert m.pool.free == 0 and not m.tables[1].any()
  assert not m.ever_fits(3 * PAGE) and m.ever_fits(2 * PAGE)


def test_prefix_cache_pages_are_evicted_for_a_growing_sequence_but_not_while_shared():
  page_bytes = 100
  m = KVManager(num_pages=4, shards=1, max_batch=2, pages_per_slot=4,
                prefix=dict(num_ckpt_slots=4, budget_bytes=10_000, page_bytes=page_bytes,
                            ckpt_bytes=1, match_tokens=PAGE))
  prompt = np.arange(1, 2 * PAGE + 11, dtype=np.int32)      # 2 whole blocks and a tail
  hashes = block_hashes(prompt)
  got = m.acquire(0, hashes, prompt.size, prompt.size + 1, step=1)
  assert len(got.pages) == 3 and got.hit_tokens == 0 and m.pool.free == 0
  reg, ckpt = m.register(0, hashes, 0, 2 * PAGE, step=1, keep_ckpt_at=2 * PAGE)
  assert reg == 2 and ckpt is not None
  m.settle(got)
  # a second sequence shares the two cached pages and waits for its third
  again = m.acquire(1, hashes, prompt.size, prompt.size + 1, step=2)
  assert again is None and m.pool.free == 0                 # pins rolled back
  m.release(0)
  assert m.pool.free == 1                                   # the cached pages stay cached
  again = m.acquire(1, hashes, prompt.size, prompt.size + 1, step=2)
  assert again.hit_tokens == 2 * PAGE and again.pages[:2] == got.pages[:2]
  m.settle(again)
  # growing needs the cache's pages: shared with slot 1, they are not evicted
  assert not m.grow(1, 4 * PAGE)
  m.release(1)
  assert m.acquire(0, [], 3 * PAGE, 3 * PAGE, step=3) is not None   # evicts both cached
  assert m.prefix.stats()["pages"] == 0 and m.prefix.evictions == 2


def test_pool_size_and_the_default_budget():
  assert kv_manager.pool_size(10 * 100 + 99, 100, shards=1, cap=1000) == 10
  assert kv_manager.pool_size(10 * 100, 100, shards=4, cap=1000) == 8       # whole stripes
  assert kv_manager.pool_size(1 << 40, 100, shards=1, cap=17) == 17         # never past use
  with pytest.raises(ValueError, match="kv_cache_bytes=150 holds 1 pages"):
    kv_manager.pool_size(150, 100, shards=1, cap=1000)
  cpu = types.SimpleNamespace(memory_stats=lambda: None)
  assert kv_manager.auto_budget([cpu], 0, 1) == (kv_manager.CPU_KV_CACHE_BYTES,
                                                 "the fixed default of a device without "
                                                 "memory statistics", False)
  gpu = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 100 << 30,
                                                    "bytes_in_use": 20 << 30})
  budget, how, measured = kv_manager.auto_budget([gpu], 10 << 30, 2)
  assert budget == int(0.8 * (70 << 30)) * 2 and "80%" in how and measured
  full = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 1, "bytes_in_use": 2})
  with pytest.raises(ValueError, match="give --kv_cache_bytes"):
    kv_manager.auto_budget([full], 0, 1)


def test_the_budget_flag_errors():
  with pytest.raises(ConfigError, match="kv_cache_bytes=-1"):
    ServeConfig(kv_cache_bytes=-1)
  cfg = tiny_serving_config()
  g, p, r = train.split_model(create_model(cfg, seed=3))
  with pytest.raises(UserError, match=r"kv_cache_bytes=1000 holds 0 pages .* raise it to"):
    Engine(cfg, g, p, r, max_batch=1, prefix_cache_bytes=0, max_len=PAGE, kv_cache_bytes=1000)


# ----- the engine on a small pool -------------------------------------------------------

@pytest.fixture(scope="module")
def small():
  """Two slots of up to 1,536 tokens over a pool of two pages (+ the null page)."""
  cfg = tiny_serving_config()
  g, p, r = train.split_model(create_model(cfg, seed=3))
  probe = Engine(cfg, g, p, r, max_batch=1, prefix_cache_bytes=0, max_len=PAGE,
                 kv_cache_bytes=1 << 20)
  # batch invariant: fixed step shapes (fewer compiles) and exact resumption to compare
  eng = Engine(cfg, g, p, r, max_batch=2, prefix_cache_bytes=0, max_len=3 * PAGE,
               kv_cache_bytes=3 * probe.page_bytes, batch_invariant=True)
  assert eng.num_pages == 3
  return eng


def prompt_of(seed, n):
  return np.random.default_rng(seed).integers(1, 256, n).astype(np.int32)


def test_a_request_larger_than_the_pool_is_refused(small):
  with pytest.raises(RequestError, match="needs 3 pages of 512 tokens; the KV cache holds 2"):
    small.submit(prompt_of(0, 1000), SamplingParams(max_tokens=100))


def test_preempted_request_resumes_exactly(small):
  """Two sequences that each cross from one page into a second on a two-page pool: both
  are admitted (one page each), the newer is preempted when the older needs its second
  page, waits, is recomputed (prompt + generated tokens) and ends with the greedy tokens
  it gets alone. Then a third request that finds the pool full waits for it."""
  prompts = [prompt_of(1, 496), prompt_of(2, 496)]
  params = SamplingParams(max_tokens=24)
  alone = []
  for q in prompts:
    req = small.submit(q, params)
    small.run_until_done([req])
    alone.append(req.output_ids)
  assert small.resource_counts()["preemptions"] == 0
  reqs = [small.submit(q, params) for q in prompts]
  seen_waiting = False
  while not all(q.state == "done" for q in reqs):
    small.step()
    seen_waiting |= small.resource_counts()["waiting"] > 0
  c = small.resource_counts()
  assert c["preemptions"] >= 1 and seen_waiting
  assert [q.output_ids for q in reqs] == alone
  assert all(q.finish_reason == "length" and q.error is None for q in reqs)
  assert c["used_pages"] == 0 and c["free_slots"] == 2          # nothing leaked


def test_the_decode_step_never_copies_a_pool(small):
  """The engine's compiled decode step (decode_step, cache donated) holds no copy of an
  MLA page pool: its latents are written in place and only the pages it needs are read,
  so its cost does not grow with the pool (benchmarks.serve --only pool times it)."""
  from k3_jax.cache import PagedMLACache
  from k3_jax.stack import cache_leaves
  eng, b = small, small.max_batch
  z, zf = np.zeros(b, np.int32), np.zeros(b, np.float32)
  batch = steps.DecodeBatch(z, z, eng.tables.copy(), np.ones(b, bool), steps.Sampling(
      z, z, zf, np.ones(b, np.float32), zf, zf, eng.runner.zero_bias(b)), z, np.zeros(b, bool))
  text = eng.runner.jitted.decode.lower(*eng.runner.weights, eng.runner.cache,
                                        eng.runner.counts, batch).compile().as_text()
  pools = {f"[{','.join(map(str, a.shape))}]" for e in cache_leaves(eng.runner.cache)
           if isinstance(e, PagedMLACache) for a in (e.c_kv, e.k_r)}
  assert pools
  copies = [ln for ln in text.splitlines()
            if re.search(r"\bcopy\(", ln) and any(p in ln.split("=")[1][:40] for p in pools)]
  assert not copies, copies[:2]


@pytest.mark.slow
def test_preemption_with_the_prefix_cache():
  """Two 1,020-token prompts (two pages each, the first block cached with its KDA
  checkpoint by earlier runs) on a four-page pool: both start from a prefix-cache hit, the
  newer is preempted when the older crosses into a third page (the cached pages are pinned,
  so nothing can be evicted), resumes from a hit on its own cached block, and both end with
  the greedy tokens of cold runs; nothing leaks but the cached pages."""
  cfg = tiny_serving_config()
  g, p, r = train.split_model(create_model(cfg, seed=3))
  probe = Engine(cfg, g, p, r, max_batch=1, prefix_cache_bytes=0, max_len=PAGE,
                 kv_cache_bytes=1 << 20)
  eng = Engine(cfg, g, p, r, max_batch=2, max_len=3 * PAGE,
               prefix_cache_bytes=8 * (probe.page_bytes + probe.ckpt_bytes),
               kv_cache_bytes=5 * probe.page_bytes)
  assert eng.num_pages == 5 and eng.prefix is not None
  prompts = [prompt_of(3, 1020), prompt_of(4, 1020)]
  params = SamplingParams(max_tokens=12)
  cold = []
  for q in prompts:
    req = eng.submit(q, params, use_prefix_cache=False)
    eng.run_until_done([req])
    cold.append(req.output_ids)
  reqs = [eng.submit(q, params) for q in prompts]
  eng.run_until_done(reqs)
  c = eng.resource_counts()
  assert c["preemptions"] >= 1
  assert all(q.cached_tokens == PAGE for q in reqs)
  assert [q.output_ids for q in reqs] == cold
  assert c["used_pages"] == c["cached_pages"] and c["pinned_checkpoints"] == 0
