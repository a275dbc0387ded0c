"""The paged decode step against the contiguous model path (k3_jax/model.py prefill +
decode_step) on the 5-layer k3_tiny variant of test_engine.py: one MLA layer inside the
scanned unit (pools read in place, latents written after the loop) and one after it (pool
written, then read). The paged side runs the serving steps (steps.prefill_step over the
whole prompt, then steps.decode_step) on shuffled physical pages beside an idle slot; the
same prompt chunk grid on both sides, so only the decode attention's summation order (an
online softmax over pages plus the token's own term, against one softmax over the cache)
differs: logits to 1e-5."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax import train
from k3_jax.model import create_model, decode_step, prefill
from k3_jax.serve import kv_pages as kv
from k3_jax.serve import steps
from k3_jax.serve.kv_pages import PAGE, PagePool
from sharding.install import parallel_for
from sharding.mesh import make_mesh, parse_mesh
from sharding.rules import tree_shardings
from tests.serve.test_engine import tiny_serving_config

TOL = 1e-5
PROMPT, NEW, PAGES = 700, 4, 4          # 700 + 4 tokens in 2 pages of a 4-page table


def paged_logits(cfg, model, prompt, num_pages, table, mesh=None):
  """Greedy logits [NEW + 1, V] of slot 0 (slot 1 idle) through the serving steps, on one
  device or with parameters and pools split over `mesh` (the engine's layout)."""
  g, p, r = train.split_model(model)
  b, v = 2, cfg.vocab_size
  cache = jax.tree.map(jnp.zeros_like,
                       jax.eval_shape(lambda: model.init_paged_cache(b, num_pages, PAGE)))
  par = parallel_for(mesh)
  if mesh is not None:
    p = jax.device_put(p, tree_shardings(p, mesh))
    r = jax.device_put(r, tree_shardings(r, mesh))
    cache = jax.device_put(cache, kv.paged_cache_shardings(cache, mesh))
  s = steps.jit_steps(g, par)
  counts = jnp.zeros((b, v), jnp.int32)
  logits, cache = s.prefill(p, r, cache, np.zeros(1, np.int32), prompt[None],
                            np.zeros(1, np.int32), table[:1], np.ones(1, bool))
  out = [np.asarray(logits[0])]
  z, zf = np.zeros(b, np.int32), np.zeros(b, np.float32)
  sampling = steps.Sampling(z, z, zf, np.ones(b, np.float32), zf, zf, np.zeros((b, v), np.float32))
  tables = np.zeros_like(table)
  tables[0] = table[0]
  for i in range(NEW):
    tok = np.array([int(np.argmax(out[-1])), 0], np.int32)
    pos = np.array([PROMPT + i, 0], np.int32)
    got, cache, counts = s.decode(p, r, cache, counts,
                                  steps.DecodeBatch(tok, pos, tables, np.array([True, False]),
                                                    sampling, z, np.zeros(b, bool)))
    out.append(np.asarray(got.logits[0]))
  return np.stack(out)


@pytest.mark.slow   # ~20 s of compiles (suite budget); the op at 2e-6: tests/ops/test_attention.py
def test_paged_decode_matches_contiguous_model():
  cfg = tiny_serving_config()
  model = create_model(cfg, seed=3)
  prompt = np.random.default_rng(7).integers(1, 256, PROMPT).astype(np.int32)
  table = np.zeros((2, PAGES), np.int32)
  table[0] = [5, 2, 7, 0]                       # out of order; the last column unused
  got = paged_logits(cfg, model, prompt, 9, table)
  logits, cache = jax.jit(lambda t: prefill(model, t, PAGES * PAGE, last_only=True))(
      jnp.asarray(prompt[None]))
  want = [np.asarray(logits[0, -1])]
  step = jax.jit(lambda c, t: decode_step(model, c, t))
  for _ in range(NEW):
    step_logits, cache = step(cache, jnp.asarray([int(np.argmax(want[-1]))], jnp.int32))
    want.append(np.asarray(step_logits[0]))
  np.testing.assert_allclose(got, np.stack(want), atol=TOL, rtol=0)


@pytest.mark.slow   # ~25 s of compiles (suite budget); the op alone: tests/sharding/test_paged.py
def test_sharded_paged_decode_matches_one_device():
  """8 devices, the pools split on their page axis and the sequence's pages striped over
  the shards (PagePool): each shard attends over its own pages, the partials combine over
  the mesh (sharding/paged.py), the KDA states are split on K, and the logits equal one
  device's to 1e-5. (Pages on the
  wrong shards fail it: 80% of the logits off.)"""
  assert len(jax.devices()) == 8
  cfg = tiny_serving_config()
  model = create_model(cfg, seed=3)
  prompt = np.random.default_rng(8).integers(1, 256, PROMPT).astype(np.int32)
  pool = PagePool(32, shards=8)
  pool.alloc(5)                                  # others' pages: ours are not the first ones
  table = np.zeros((2, PAGES), np.int32)
  table[0, :2] = pool.alloc(2)
  assert [pool.shard_of(q) for q in table[0, :2]] == [0, 1]
  mesh = make_mesh(parse_mesh("data:8"))
  # A batch of 2 cannot use the 8-way axis: each KDA state is split on K instead
  # (kv_pages.paged_cache_shardings), and the decode's sums over K are all-reduces.
  cache = jax.eval_shape(lambda: model.init_paged_cache(2, 32, PAGE))
  states = [e.state for e in jax.tree.leaves(kv.paged_cache_shardings(cache, mesh),
                                             is_leaf=lambda x: hasattr(x, "conv_q"))
            if hasattr(e, "conv_q")]
  assert states and all(s.spec[-2] == "data" for s in states)
  got = paged_logits(cfg, model, prompt, 32, table, mesh)
  want = paged_logits(cfg, model, prompt, 32, table)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
