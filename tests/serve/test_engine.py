"""The batched engine and its KDA-aware prefix cache (docs/architecture.md section 9).

One engine (module fixture) on a 5-layer k3_tiny variant (KDA, KDA, KDA, MLA, MLA with MoE
and Attention Residuals), 2 slots, a prefix-cache budget of about four 512-token blocks with
their checkpoints, so that eviction happens within the test sequence.

Tolerances: a hit and a cold prefill of the same prompt run the same computations on the
same 512-token chunk grid (the hit's chunks start from a bit-copy of the checkpointed KDA
state and read bit-identical MLA latents from other physical pages), so their logits agree
to float32 rounding: 1e-5. Against the unpaged model path (one prefill over the whole
prompt, then decode_step) the summation order of attention and the chunk grid differ:
1e-4 on logits of O(1) magnitude in float32.
"""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

import configs
from k3_jax import train
from k3_jax.config import apply_overrides, validate
from k3_jax.data.tokenizers import ByteTokenizer
from k3_jax.model import create_model, decode_step, prefill
from k3_jax.config import SINGLE_STREAM
from k3_jax.serve.engine import Engine, QueueFull, RequestError, SamplingParams
from k3_jax.serve.kv_pages import PAGE
from k3_jax.serve.prefix_cache import block_hashes
from k3_jax.serve.prefill_chunks import checkpoint_boundaries, prefill_plan

HIT_TOL = 1e-5
REF_TOL = 1e-4
OVERRIDES = ["max_seq_len=2048", "num_layers=5", "mla_layers=(4,5)"]


def tiny_serving_config():
  return validate(apply_overrides(configs.get("k3_tiny"), OVERRIDES))


@pytest.fixture(scope="module")
def setup(prefix_setup):
  return prefix_setup             # (conftest.py: test_cache_tiers.py shares its compiled steps)


def prompt_of(seed, n):
  return np.random.default_rng(seed).integers(1, 256, n).astype(np.int32)


def run(eng, prompt, n=4, **kw):
  req = eng.submit(prompt, SamplingParams(max_tokens=n), record_logits=True, **kw)
  eng.run_until_done([req])
  return req


def assert_same(hit, cold):
  assert hit.output_ids == cold.output_ids
  assert len(hit.logits) == len(cold.logits) == len(cold.output_ids)
  for a, b in zip(hit.logits, cold.logits):
    np.testing.assert_allclose(a, b, atol=HIT_TOL, rtol=0)


def test_prefill_plan_and_boundaries():
  assert prefill_plan(0, 1280, 512) == [512]
  assert prefill_plan(1024, 1280, 512) == [256]
  assert prefill_plan(1024, 1300, 512) == [256, 16, 4]
  assert prefill_plan(0, 511, 512) == [256] + [64] * 3 + [16] * 3 + [4] * 3 + [1] * 3
  assert prefill_plan(0, 1024, 1024) == [512]          # stops on the kept boundary at 512
  assert prefill_plan(0, 1536, 1024) == [1024]
  assert checkpoint_boundaries(1280) == (1024,)
  assert checkpoint_boundaries(1024) == (512, 1024)
  assert checkpoint_boundaries(130) == ()
  a, b = prompt_of(0, 1100), prompt_of(0, 1100)
  b[700] += 1
  ha, hb = block_hashes(a), block_hashes(b)
  assert len(ha) == 2 and ha[0] == hb[0] and ha[1] != hb[1]     # chained: block 2 differs


def test_cold_matches_unpaged_model(setup):
  cfg, model, eng = setup
  prompt = prompt_of(1, 1280)
  req = run(eng, prompt, use_prefix_cache=False)
  logits, cache = jax.jit(lambda t: prefill(model, t, 1300))(jnp.asarray(prompt[None]))
  step = jax.jit(lambda c, t: decode_step(model, c, t))
  ref_logits, ids = [np.asarray(logits[0, -1])], [int(jnp.argmax(logits[0, -1]))]
  for _ in range(3):
    step_logits, cache = step(cache, jnp.asarray([ids[-1]], jnp.int32))
    ref_logits.append(np.asarray(step_logits[0]))
    ids.append(int(jnp.argmax(step_logits[0])))
  assert req.output_ids == ids
  for a, b in zip(req.logits, ref_logits):
    np.testing.assert_allclose(a, b, atol=REF_TOL, rtol=0)


def test_hit_on_block_boundary_prompt(setup):
  _, _, eng = setup
  prompt = prompt_of(2, 1024)              # ends exactly on a boundary: the hit is 512
  cold = run(eng, prompt)
  hit = run(eng, prompt)
  assert cold.cached_tokens == 0 and hit.cached_tokens == 512
  assert_same(hit, cold)


def test_hit_mid_block_prompt(setup):
  _, _, eng = setup
  prompt = prompt_of(3, 1280)
  cold = run(eng, prompt)
  hit = run(eng, prompt)
  assert hit.cached_tokens == 1024
  assert_same(hit, cold)
  longer = np.concatenate([prompt, prompt_of(4, 256)])   # a next turn extends the prompt
  cold2 = run(eng, longer, use_prefix_cache=False)
  hit2 = run(eng, longer)
  assert hit2.cached_tokens == 1024
  assert_same(hit2, cold2)


def test_two_sharing_requests_interleaved(setup):
  _, _, eng = setup
  shared = prompt_of(5, 1024)
  seed_req = run(eng, np.concatenate([shared, prompt_of(6, 256)]))   # caches the prefix
  a = np.concatenate([shared, prompt_of(7, 256)])
  b = np.concatenate([shared, prompt_of(8, 256)])
  cold_a, cold_b = run(eng, a, 6, use_prefix_cache=False), run(eng, b, 6, use_prefix_cache=False)
  ra = eng.submit(a, SamplingParams(max_tokens=6), record_logits=True)
  rb = eng.submit(b, SamplingParams(max_tokens=6), record_logits=True)
  overlap = 0
  while ra.state != "done" or rb.state != "done":
    eng.step()
    overlap += ra.state == "decode" and rb.state in ("prefill", "decode")
  assert overlap > 0                                   # they really shared the batch
  assert seed_req.cached_tokens == 0 and ra.cached_tokens == rb.cached_tokens == 1024
  assert ra.slot != rb.slot
  assert_same(ra, cold_a)
  assert_same(rb, cold_b)


def test_hit_after_slot_reuse(setup):
  _, _, eng = setup
  p = prompt_of(9, 1280)
  first = run(eng, p)
  other = run(eng, prompt_of(10, 768), 8, use_prefix_cache=False)
  assert other.slot == first.slot                       # the slot now holds another state
  again = run(eng, p)
  assert again.slot == other.slot and again.cached_tokens == 1024
  assert_same(again, first)


def _evict_around(eng, keep, newcomers, hit_tokens, cold, same):
  """Newcomer prompts push the prefix cache past its budget while `keep` stays recently
  used: `keep` still hits `hit_tokens` (and equals its cold run by `same`), evictions
  happened within the budget, and the oldest newcomer is gone."""
  before = eng.prefix.stats()["evictions"]
  for q in newcomers:
    run(eng, q, 2)
    assert run(eng, keep, 2).cached_tokens == hit_tokens   # keeps `keep` recently used
  stats = eng.prefix.stats()
  assert stats["evictions"] > before and stats["bytes"] <= stats["budget_bytes"]
  hit = run(eng, keep)
  assert hit.cached_tokens == hit_tokens
  same(hit, cold)
  assert run(eng, newcomers[0], 2).cached_tokens == 0     # the oldest newcomer is gone

def test_hit_after_eviction_pressure(setup):
  _, _, eng = setup
  keep = prompt_of(11, 1280)
  cold = run(eng, keep)
  _evict_around(eng, keep, [prompt_of(s, 1280) for s in range(12, 15)], 1024, cold,
                assert_same)                            # three new 2-block prompts
  assert eng.pool.free == eng.num_pages - 1 - len(eng.prefix.entries)   # nothing leaked


def test_sampling_per_request_and_stops(setup):
  _, _, eng = setup
  p = prompt_of(20, 256)
  params = SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=7,
                          presence_penalty=0.5, frequency_penalty=0.5)
  solo = eng.submit(p, params)
  eng.run_until_done([solo])
  # the same seeded request next to another one gives the same tokens (per-row keys)
  r1 = eng.submit(p, params)
  r2 = eng.submit(prompt_of(21, 256), SamplingParams(max_tokens=5, temperature=1.0, seed=1))
  eng.run_until_done([r1, r2])
  assert r1.output_ids == solo.output_ids
  # stop ids: generation ends at the first stop id; stop strings cut the text
  greedy = run(eng, p, 5)
  stop_at = greedy.output_ids[2]
  s = eng.submit(p, SamplingParams(max_tokens=5, stop_ids=(stop_at,)))
  eng.run_until_done([s])
  assert s.output_ids == greedy.output_ids[:greedy.output_ids.index(stop_at) + 1]
  assert s.finish_reason == "stop"
  text = ByteTokenizer().decode(greedy.output_ids)
  if text[1:3]:
    t = eng.submit(p, SamplingParams(max_tokens=5, stop=(text[1:3],)))
    eng.run_until_done([t])
    assert t.finish_reason == "stop" and t.text == text[:text.index(text[1:3])]


def test_bad_requests(setup):
  _, _, eng = setup
  with pytest.raises(RequestError, match="empty"):
    eng.submit([], SamplingParams())
  with pytest.raises(RequestError, match="exceeds the context"):
    eng.submit(prompt_of(0, 2000), SamplingParams(max_tokens=100))
  with pytest.raises(RequestError, match="top_p"):
    eng.submit([1, 2], SamplingParams(top_p=0.0))
  with pytest.raises(RequestError, match="temperature"):
    eng.submit([1, 2], SamplingParams(temperature=-1.0))
  with pytest.raises(RequestError, match="vocabulary"):
    eng.submit([1, 999], SamplingParams())
  old, eng.max_queue = eng.max_queue, 1
  try:
    q = eng.submit([1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFull):
      eng.submit([1, 2], SamplingParams(max_tokens=2))
    q.cancel()
    eng.step()
    assert q.finish_reason == "cancelled"
  finally:
    eng.max_queue = old
  assert not eng.running and not eng.waiting and len(eng.free_slots) == 2


@pytest.mark.slow   # 30-80 s of compiles (suite budget); the sharded model itself: tests/sharding
def test_sharded_engine_matches_one_device(setup):
  """Expert parallelism over 8 CPU devices (--mesh=expert:8) gives the same greedy tokens
  as one device (logits to 1e-4: the expert all-to-all reorders float32 sums)."""
  from sharding.mesh import make_mesh, parse_mesh
  cfg, model, eng = setup
  assert len(jax.devices()) == 8
  g, p, r = train.split_model(model)
  sharded = Engine(cfg, g, p, r, SINGLE_STREAM, max_batch=2, mesh=make_mesh(parse_mesh("expert:8")))
  prompts = [prompt_of(30, 256), prompt_of(31, 256)]       # both in the batch at once
  ref = [run(eng, q, 4, use_prefix_cache=False) for q in prompts]
  reqs = [sharded.submit(q, SamplingParams(max_tokens=4), record_logits=True) for q in prompts]
  sharded.run_until_done(reqs)
  for a, b in zip(reqs, ref):
    assert a.output_ids == b.output_ids
    for x, y in zip(a.logits, b.logits):
      np.testing.assert_allclose(x, y, atol=REF_TOL, rtol=0)


# ----- a finer prefix match grid (--prefix_match_tokens=64) ----------------------------------
# The same model and budget with hits on a 64-token grid. It reuses the compiled steps of the
# module engine (same model, same cache shapes). A hit of an identical prompt runs the same
# pieces from the same bits as the cold prefill, so these compare logits bitwise.

MATCH = 64


@pytest.fixture(scope="module")
def grid(setup):
  cfg, model, eng = setup
  g, p, r = train.split_model(model)
  out = Engine(cfg, g, p, r, max_batch=2, prefix_cache_bytes=eng.serve.prefix_cache_bytes,
               prefix_match_tokens=MATCH, tokenizer=ByteTokenizer())
  assert out.num_pages == eng.num_pages
  out.runner.steps = eng.runner.steps                 # no second compile
  return out


def assert_bitwise(hit, cold):
  assert hit.output_ids == cold.output_ids
  assert len(hit.logits) == len(cold.logits) == len(cold.output_ids)
  for a, b in zip(hit.logits, cold.logits):
    assert np.array_equal(a, b)


def test_grid_plan_and_boundaries():
  assert checkpoint_boundaries(100, MATCH) == (64,)
  assert checkpoint_boundaries(128, MATCH) == (64, 128)          # ends on the grid
  assert checkpoint_boundaries(64, MATCH) == (64,)               # no hit can use it
  assert checkpoint_boundaries(1300, MATCH) == (1024, 1280)
  assert checkpoint_boundaries(1024, MATCH) == (960, 1024)
  assert prefill_plan(0, 100, 512, MATCH) == [64]                # stops on the checkpoint
  assert prefill_plan(64, 100, 512, MATCH) == [16, 16, 4]
  assert prefill_plan(0, 1300, 1024, MATCH) == [1024]
  assert prefill_plan(576, 1300, 1024, MATCH) == [256, 64, 64, 64]   # to the block boundary
  assert prefill_plan(1024, 1300, 1024, MATCH) == [256]
  assert prefill_plan(512, 1024, 512, MATCH) == [256, 64, 64, 64]
  a = prompt_of(0, 200)
  assert len(block_hashes(a, MATCH)) == 3
  assert block_hashes(a, MATCH)[:1] == block_hashes(a[:64], MATCH)
  from k3_jax.config import ConfigError, ServeConfig
  for bad in (0, 48, 1024):
    with pytest.raises(ConfigError, match="prefix_match_tokens"):
      ServeConfig(prefix_match_tokens=bad)


def test_grid_short_prompt_hits(grid):
  x = prompt_of(40, 100)                # shorter than one 512-token block
  cold = run(grid, x, use_prefix_cache=False)       # (still caches its blocks)
  hit = run(grid, x)
  assert cold.cached_tokens == 0 and hit.cached_tokens == 64
  assert_bitwise(hit, cold)
  longer = np.concatenate([x, prompt_of(41, 60)])     # shares x's 100 tokens: hits 64
  hit2 = run(grid, longer)
  cold2 = run(grid, longer, use_prefix_cache=False)
  assert hit2.cached_tokens == 64
  assert_bitwise(hit2, cold2)          # the hit resumes where the cold prefill cut too (64)


def test_grid_boundary_prompt_and_partial_page_decode(grid):
  # 640 tokens end on the grid: an identical prompt hits 576 = 512 + 64 (one shared page,
  # the first 64 latents of the second page copied), then decodes 8 tokens into its copy
  p = prompt_of(42, 640)
  cold = run(grid, p, 8, use_prefix_cache=False)
  hit = run(grid, p, 8)
  assert hit.cached_tokens == 576
  assert_bitwise(hit, cold)
  again = run(grid, p, 8)                              # the source page was not written
  assert again.cached_tokens == 576
  assert_bitwise(again, cold)
  # mid-page, past a block: 1,300 tokens hit 1,280 (two shared pages + a copy of 256)
  q = prompt_of(43, 1300)
  coldq = run(grid, q, 6, use_prefix_cache=False)
  run(grid, q, 2)
  hitq = run(grid, q, 6)
  assert hitq.cached_tokens == 1280
  assert_bitwise(hitq, coldq)


def test_grid_eviction(grid):
  keep = prompt_of(44, 700)
  cold = run(grid, keep, use_prefix_cache=False)
  run(grid, keep, 2)
  _evict_around(grid, keep, [prompt_of(s, 900) for s in range(45, 49)], 640, cold,
                assert_bitwise)
  c = grid.resource_counts()
  assert c["used_pages"] == c["cached_pages"] == len(grid.prefix.page_entries)   # no leak
  assert c["pinned_blocks"] == 0 and c["pinned_checkpoints"] == 0
