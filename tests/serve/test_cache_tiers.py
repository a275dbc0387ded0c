"""The prefix cache's host-memory and disk tiers (serve/cache_tiers.py, serve/cache_disk.py).

Engines: the tiny serving config's 2-slot engine of test_engine.py (conftest prefix_setup,
whose compiled steps they share), whose device prefix cache holds about four 512-token blocks
with their checkpoints: two prompts of two blocks each (a checkpoint at 1,024) fit, a third
pushes the first out of device memory.

A block restored from host memory or disk is the bits that were demoted, so a restored hit
runs the same computation from the same bits as a device hit and as the cold prefill of the
same prompt (same pieces: 512, 512, then the 276-token tail): logits compared bitwise.
"""

import logging
import os

import numpy as np
import pytest

from k3_jax import train
from k3_jax.data.tokenizers import ByteTokenizer
from k3_jax.model import create_model
from k3_jax.serve import cache_disk
from k3_jax.serve.cache_tiers import CacheTiers, HostTier, TierMetrics, _Shared
from k3_jax.serve.engine import Engine
from k3_jax.serve.kv_pages import PAGE, PagePool
from k3_jax.serve.prefix_cache import PrefixCache, block_hashes
from tests.serve.test_engine import assert_bitwise, prompt_of, run

N = 1300        # prompt tokens: two blocks, a checkpoint at 1,024, a tail (test_engine.py's shapes)


@pytest.fixture(scope="module")
def parts(prefix_setup):
  cfg, model, eng = prefix_setup
  return cfg, train.split_model(model), eng


def make(parts, **kw):
  """An engine of the shared engine's shapes (its compiled steps), with tiers `kw`."""
  cfg, (g, p, r), shared = parts
  eng = Engine(cfg, g, p, r, max_batch=2, prefix_cache_bytes=shared.serve.prefix_cache_bytes,
               tokenizer=ByteTokenizer(), **kw)
  assert eng.num_pages == shared.num_pages
  eng.runner.steps = shared.runner.steps                 # no second compile
  return eng


@pytest.fixture(scope="module")
def host_engine(parts):
  return make(parts, host_cache_bytes=1 << 30)


def test_host_tier_round_trip_is_bitwise(host_engine):
  eng, a, b, c = host_engine, prompt_of(1, N), prompt_of(2, N), prompt_of(5, N)
  cold = run(eng, a, use_prefix_cache=False)            # caches a's blocks on the device
  hs = block_hashes(a)
  pages = [eng.prefix.entries[h].page for h in hs]
  before = [np.asarray(x) for p in pages for x in eng.tiers.io.read_page(p)]
  ckpt = [np.asarray(x) for x in eng.tiers.io.read_ckpt(eng.prefix.entries[hs[1]].ckpt)]
  run(eng, b)
  run(eng, c)                                            # pushes a's blocks to the host
  assert not any(h in eng.prefix.entries for h in hs)
  assert all(h in eng.tiers.host for h in hs)
  got = [eng.tiers.host.get(h) for h in hs]
  assert all(np.array_equal(x, y) for x, y in zip(before, got[0].page + got[1].page))
  assert got[0].ckpt is None and all(np.array_equal(x, y) for x, y in zip(ckpt, got[1].ckpt))
  hit = run(eng, a)                                      # promoted back: a hit from the host
  assert hit.cached_tokens == 2 * PAGE
  assert_bitwise(hit, cold)
  s = eng.tiers.stats
  assert s["host"].hit_tokens == 2 * PAGE and s["host"].blocks_in == 2
  assert all(h in eng.prefix.entries for h in hs) and not any(h in eng.tiers.host for h in hs)
  assert all(h in eng.tiers.host for h in block_hashes(b))    # b went down in its place
  assert eng.tiers.summary()["host_blocks"] == 2
  c = eng.resource_counts()
  assert c["used_pages"] == c["cached_pages"] and c["pinned_checkpoints"] == 0
  from prometheus_client import CollectorRegistry, generate_latest
  reg = CollectorRegistry()
  reg.register(TierMetrics(eng))
  text = generate_latest(reg).decode()
  assert f'k3_prefix_cache_tier_hit_tokens_total{{tier="host"}} {2 * PAGE}.0' in text
  assert 'k3_prefix_cache_tier_promoted_blocks_total{tier="host"} 2.0' in text
  assert f'k3_prefix_cache_tier_bytes{{tier="host"}} {float(eng.tiers.host.used)}' in text


def test_disk_tier_hit_and_restart(parts, tmp_path, caplog):
  d = str(tmp_path / "cache")
  eng = make(parts, disk_cache_dir=d)                    # no host tier: device -> disk
  a, b, c = prompt_of(3, N), prompt_of(4, N), prompt_of(6, N)
  cold = run(eng, a, use_prefix_cache=False)
  run(eng, b)
  run(eng, c)
  eng.tiers.disk.flush()
  assert len(os.listdir(d)) == 2                         # a's blocks
  hit = run(eng, a)
  assert hit.cached_tokens == 2 * PAGE and eng.tiers.stats["disk"].hit_tokens == 2 * PAGE
  assert eng.tiers.disk.prefetched == 2        # read on the reader thread from submit on
  assert_bitwise(hit, cold)
  eng.tiers.disk.flush()
  assert len(os.listdir(d)) == 4                         # + b's, pushed out by a's return

  again = make(parts, disk_cache_dir=d)                  # a restarted server, same model
  assert len(again.tiers.disk.index) == 4
  first = run(again, a)                                  # the first returning request hits
  assert first.cached_tokens == 2 * PAGE
  assert_bitwise(first, cold)

  # damaged: b's checkpoint block with a payload byte flipped (caught when read), a's first
  # block's file cut inside its header (caught at the scan)
  hb = block_hashes(b)
  path = again.tiers.disk.path(hb[1])
  data = bytearray(open(path, "rb").read())
  data[-5] ^= 0xFF
  open(path, "wb").write(bytes(data))
  with open(again.tiers.disk.path(block_hashes(a)[0]), "r+b") as f:
    f.truncate(12)
  with caplog.at_level(logging.WARNING, logger="k3_jax.serve"):
    third = make(parts, disk_cache_dir=d)
    assert third.tiers.disk.skipped == 1 and "skipping" in caplog.text
    caplog.clear()
    hit_b = run(third, b)
    assert third.tiers.disk.skipped == 2 and "digest mismatch" in caplog.text
  assert hit_b.cached_tokens == 0 and run(third, a).cached_tokens == 0   # nothing damaged served
  assert_bitwise(hit_b, run(third, b, use_prefix_cache=False))

  # another model (different weights): its files are not served
  cfg, _, shared = parts
  other = train.split_model(create_model(cfg, seed=4))
  with caplog.at_level(logging.WARNING, logger="k3_jax.serve"):
    eng4 = make((cfg, other, shared), disk_cache_dir=d)
  assert not eng4.tiers.disk.index and "fingerprint" in caplog.text


def test_write_around_when_the_device_cache_is_pinned_full(parts):
  # the device cache's budget full of blocks running requests hold: a new prompt's blocks
  # (and its checkpoint, the slot's KDA state) go straight to the host tier, and its next
  # request hits them there, bitwise the cold prefill
  eng = make(parts, host_cache_bytes=1 << 30)
  pc, held, k = eng.prefix, [], 0
  while True:                                            # pinned blocks until it is full
    (page,) = eng.pool.alloc(1, 0)
    ok = pc.register_block(bytes([k]) * 16, None, page, -1)
    held.append(page)
    k += 1
    if not ok:
      break
  a = prompt_of(9, N)
  cold = run(eng, a, use_prefix_cache=False)
  hs = block_hashes(a)
  assert not any(h in pc.entries for h in hs) and all(h in eng.tiers.host for h in hs)
  assert eng.tiers.host.has_ckpt(hs[1]) and eng.tiers.stats["host"].written_around == 2
  eng.pool.decref(held)                                  # those requests finished
  hit = run(eng, a)
  assert hit.cached_tokens == 2 * PAGE and eng.tiers.stats["host"].hit_tokens == 2 * PAGE
  assert_bitwise(hit, cold)


# ----- bookkeeping alone (no model) ---------------------------------------------------------

class FakeIO:
  """Pages and checkpoint rows as numpy arrays: what EngineIO reads and writes."""

  def __init__(self, pages, ckpts):
    self.pages = {p: np.full(4, p, np.float32) for p in range(pages)}
    self.ckpts = {c: np.full(2, 100 + c, np.float32) for c in range(ckpts)}

  def read_page(self, p):
    return [self.pages[p].copy()]

  def read_ckpt(self, c):
    return [self.ckpts[c].copy()]

  def write_page(self, p, leaves):
    self.pages[p] = np.asarray(leaves[0]).copy()

  def write_ckpt(self, c, leaves):
    self.ckpts[c] = np.asarray(leaves[0]).copy()


def test_host_tier_evicts_least_recent_and_shares_page_copies():
  host = HostTier(budget=250)
  one = _Shared([np.zeros(1)])
  assert host.put(b"a", None, one, None, 100, 10) == []
  assert host.put(b"b", b"a", one, [np.zeros(1)], 100, 10) == []    # shares a's page copy
  assert host.used == 110
  assert host.put(b"c", b"b", _Shared([np.zeros(1)]), None, 100, 10) == []
  assert host.put(b"d", None, _Shared([np.zeros(1)]), None, 100, 10) == [b"a", b"b"]
  assert list(host.blocks) == [b"c", b"d"] and host.used == 200
  assert host.put(b"d", None, _Shared([np.zeros(1)]), [np.zeros(1)], 100, 10) == []
  assert list(host.blocks) == [b"c", b"d"] and host.used == 210     # replaced, not doubled


def test_demote_and_promote_bookkeeping():
  # a device cache of one page + one checkpoint; two 2-block chains on a 256-token grid (one page)
  pool = PagePool(8)
  pc = PrefixCache(pool, num_ckpt_slots=2, budget_bytes=110, page_bytes=100, ckpt_bytes=10,
                   match_tokens=256)
  io = FakeIO(8, 2)
  tiers = CacheTiers(pc, io, host_bytes=1000)
  x = [b"x0", b"x1"]
  (p,) = pool.alloc(1)
  assert pc.register_block(x[0], None, p, 1) and pc.register_block(x[1], x[0], p, 1)
  c = pc.alloc_checkpoint(x[1])
  io.pages[p][:] = 7
  io.ckpts[c][:] = 70
  pool.decref([p])                                       # the request finished
  assert pc._evict_one() and pc._evict_one()             # leaf first: x1, then x0
  assert not pc.entries and list(tiers.host.blocks) == [x[1], x[0]]
  assert tiers.host.used == 110                          # one shared page copy + the ckpt
  promoted = tiers.promote(x + [b"x2"], 2, step=5)
  assert promoted == {0: "host", 1: "host"} and not tiers.host.blocks
  e0, e1 = pc.entries[x[0]], pc.entries[x[1]]
  assert e0.page == e1.page and np.all(io.pages[e0.page] == 7)   # one page for both blocks
  assert e1.ckpt is not None and np.all(io.ckpts[e1.ckpt] == 70)
  hit = pc.lookup(x, 2, step=5)
  assert hit.tokens == 512 and hit.pages == [e0.page]
  tiers.counted(hit.blocks, promoted)
  assert tiers.stats["host"].hit_tokens == 512 and tiers.stats["device"].hit_tokens == 0


def test_disk_file_format_checks(tmp_path):
  import ml_dtypes
  blk = cache_disk.Block(b"p" * 16, [np.arange(6, dtype=np.float32).reshape(2, 3),
                                     np.arange(4).astype(ml_dtypes.bfloat16)],
                         [np.ones(2, np.int32)])
  data = cache_disk.encode("fp", b"h" * 16, blk)
  back = cache_disk.decode(data, "fp", b"h" * 16)
  assert back.parent == blk.parent and np.array_equal(back.page[0], blk.page[0])
  assert back.page[1].dtype == ml_dtypes.bfloat16 and np.array_equal(back.page[1], blk.page[1])
  assert back.ckpt[0].dtype == np.int32 and np.array_equal(back.ckpt[0], blk.ckpt[0])
  for bad, match in ((data[:-1], "digest"), (data[:5], "magic"),
                     (data.replace(b'"fp"', b'"fq"'), "fingerprint")):
    with pytest.raises(ValueError, match=match):
      cache_disk.decode(bad, "fp", b"h" * 16)
  with pytest.raises(ValueError, match="holds block"):
    cache_disk.decode(data, "fp", b"g" * 16)


# ----- the state after decoded tokens (serve/turn_cache.py) ----------------------------------
# A hit through decoded tokens reads latents and a KDA state the decode step computed one
# token at a time; the cold prefill computes them in chunks: float32 rounding apart, 1e-4 on
# logits of O(1) (the tolerance of test_engine.py against the unpaged model path).

DECODED_TOL = 1e-4


def test_next_turn_hits_through_the_previous_answer(parts):
  eng = make(parts)
  a = prompt_of(7, 1012)
  first = run(eng, a, 16)                   # decodes past 1,024: a checkpoint there
  assert first.finish_reason == "length" and eng.turns.registered_blocks == 1
  nxt = np.concatenate([a, np.asarray(first.output_ids, np.int32), prompt_of(8, 272)])
  hit = run(eng, nxt, 4)
  assert hit.cached_tokens == 2 * PAGE      # through the answer, not only the prompt (512)
  cold = run(eng, nxt, 4, use_prefix_cache=False)
  assert hit.output_ids == cold.output_ids
  for x, y in zip(hit.logits, cold.logits):
    np.testing.assert_allclose(x, y, atol=DECODED_TOL, rtol=0)
  c = eng.resource_counts()
  assert c["used_pages"] == c["cached_pages"] and c["pinned_checkpoints"] == 0


def test_k3_template_sends_the_answer_back_as_generated(k3_tokenizer):
  # The next turn's prompt is the previous prompt, then the answer's ids as the model wrote
  # them (its canonical tokenization), when the client sends the reasoning back; without
  # it the think channel renders empty and the match ends at the previous prompt.
  from k3_jax.data.chat import template_for
  t = template_for(k3_tokenizer)
  turn = [{"role": "system", "content": "Be brief."},
          {"role": "user", "content": "What is the weather in Paris today?"}]
  answer = {"role": "assistant", "content": "It is sunny and 21 degrees.",
            "reasoning_content": "Let me think about the question."}
  prev = t.render(turn).ids
  wrote = t.render_conversation(turn + [answer])[0]      # the prompt, then what the model wrote
  assert wrote[:len(prev)] == prev
  again = t.render(turn + [answer, {"role": "user", "content": "And tomorrow?"}]).ids
  assert again[:len(wrote)] == wrote
  bare = {k: v for k, v in answer.items() if k != "reasoning_content"}
  dropped = t.render(turn + [bare, {"role": "user", "content": "And tomorrow?"}]).ids
  common = next(i for i, (x, y) in enumerate(zip(dropped, wrote)) if x != y)
  assert common == len(prev)


def test_disk_tier_evicts_least_recent_and_keeps_checkpoints(tmp_path):
  page = [np.zeros(2500, np.float32)]                    # ~10 KB files: two fit the budget
  disk = cache_disk.DiskTier(str(tmp_path), 25_000, "fp")
  for h in (b"a", b"b", b"c"):
    disk.put(h, cache_disk.Block(None, page, None))
  disk.flush()
  assert list(disk.index) == [b"b", b"c"] and disk.evictions == 1
  assert disk.get(b"b") is not None                      # read: now the most recent
  disk.put(b"d", cache_disk.Block(None, page, None))
  disk.flush()
  assert list(disk.index) == [b"b", b"d"] and disk.used <= disk.budget
  assert sorted(os.listdir(tmp_path)) == [b"b".hex() + ".k3c", b"d".hex() + ".k3c"]
  disk.put(b"b", cache_disk.Block(None, page, [np.ones(3, np.float32)]))   # gained a ckpt
  disk.flush()
  assert disk.index[b"b"].has_ckpt and np.array_equal(disk.get(b"b").ckpt[0], np.ones(3))
  again = cache_disk.DiskTier(str(tmp_path), 25_000, "fp")   # a restart: the same blocks
  assert set(again.index) == {b"b", b"d"} and again.index[b"b"].has_ckpt


def test_persist_writes_device_and_host_blocks(tmp_path):
  # what a draining server does: every block of the device and host tiers to disk, once
  pool = PagePool(8)
  pc = PrefixCache(pool, num_ckpt_slots=2, budget_bytes=1000, page_bytes=100, ckpt_bytes=10)
  io = FakeIO(8, 2)
  disk = cache_disk.DiskTier(str(tmp_path), 1 << 20, "fp")
  tiers = CacheTiers(pc, io, host_bytes=1000, disk=disk)
  a, b = pool.alloc(2)
  assert pc.register_block(b"x", None, a, 1) and pc.register_block(b"y", b"x", b, 1)
  c = pc.alloc_checkpoint(b"y")
  pool.decref([a, b])
  tiers.host.put(b"z", b"y", _Shared([np.zeros(4, np.float32)]), None, 100, 10)
  assert tiers.persist() == 3 and tiers.persist() == 0
  assert set(disk.index) == {b"x", b"y", b"z"} and disk.index[b"y"].has_ckpt
  assert np.array_equal(disk.get(b"y").ckpt[0], io.ckpts[c])


def test_disk_reads_run_ahead_of_the_step(tmp_path, monkeypatch):
  # a promotion that needs blocks still being read from disk is put off while other
  # requests run (the step does not wait); with nothing else to run it waits for them
  import threading
  import types
  pool = PagePool(8)
  pc = PrefixCache(pool, num_ckpt_slots=2, budget_bytes=110, page_bytes=100, ckpt_bytes=10,
                   match_tokens=256)     # one page: the blocks of a column come back in one page
  io = FakeIO(8, 2)
  io.engine = types.SimpleNamespace(running=[object()])
  disk = cache_disk.DiskTier(str(tmp_path), 1 << 20, "fp")
  tiers = CacheTiers(pc, io, host_bytes=0, disk=disk)
  tokens = np.arange(600) % 97
  x = block_hashes(tokens, 256)
  (p,) = pool.alloc(1)
  assert pc.register_block(x[0], None, p, 1) and pc.register_block(x[1], x[0], p, 1)
  io.ckpts[pc.alloc_checkpoint(x[1])][:] = 70
  io.pages[p][:] = 7
  pool.decref([p])
  assert pc._evict_one() and pc._evict_one() and not pc.entries   # demoted to disk
  disk.flush()
  gate, read = threading.Event(), disk._read
  monkeypatch.setattr(disk, "_read", lambda h: gate.wait(10) and read(h))
  tiers.prefetch(tokens)                                 # a request is queued
  assert disk.reading(x)
  assert tiers.promote(x, 2, step=5) is None and tiers.deferred == 1 and not pc.entries
  gate.set()
  io.engine.running = []                                 # nothing else to run: it waits
  assert tiers.promote(x, 2, step=5) == {0: "disk", 1: "disk"}
  assert disk.prefetched == 2 and disk.reads == 2 and not disk.ready and disk.ready_bytes == 0
  e0, e1 = pc.entries[x[0]], pc.entries[x[1]]
  assert e0.page == e1.page and np.all(io.pages[e1.page] == 7) and np.all(io.ckpts[e1.ckpt] == 70)
