"""The paged decode attention on 8 CPU devices (sharding/paged.py): pools split on their
page axis, the pages of each sequence striped over the shards by the PagePool, each shard
over its own columns, the softmax partials combined over the mesh; equal to one device's
(k3_jax/layers/mla.paged_attention) to float32 rounding, for flat and stacked (scanned)
pools, on a one-axis (slow) and a two-axis mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from k3_jax.layers.mla import paged_attention
from k3_jax.ops.rope_pages import fold_pages
from k3_jax.serve.kv_pages import PagePool
from sharding import paged
from sharding.mesh import make_mesh, parse_mesh


@pytest.mark.parametrize("spec,stacked", [
    pytest.param("data:8", False, marks=pytest.mark.slow),   # suite budget: one default case
    ("expert:4,fsdp:2", True)])
def test_sharded_paged_attention_matches_one_device(spec, stacked):
  mesh = make_mesh(parse_mesh(spec))
  b, h, r, pr, page, m, n = 3, 2, 8, 4, 4, 11, 64
  pool = PagePool(n, shards=8)
  pool.alloc(9)
  table = np.zeros((b, m), np.int32)
  pos = np.array([0, 17, 43], np.int32)                  # nothing cached / 5 pages / all 11
  for i, p in enumerate(pos):
    cols = p // page + 1
    table[i, :cols] = pool.alloc(cols)
  k = jax.random.split(jax.random.key(0), 4)
  units = (2,) if stacked else ()
  pool_c = jax.random.normal(k[0], units + (n, page, r))
  pool_r = fold_pages(jax.random.normal(k[1], units + (n, page, pr)))   # [.., n, 1, 16]
  q_lat, q_rope = jax.random.normal(k[2], (b, h, r)), jax.random.normal(k[3], (b, h, pr))
  unit = jnp.int32(1) if stacked else None
  want = paged_attention(q_lat, q_rope, pool_c, pool_r, unit, table, pos, 0.3)
  split = NamedSharding(mesh, P(*((None,) * len(units)), paged.page_axes(mesh), None, None))
  pool_c, pool_r = jax.device_put(pool_c, split), jax.device_put(pool_r, split)
  got = jax.jit(lambda *a: paged.paged_attention(mesh, *a, 0.3, 2))(
      q_lat, q_rope, pool_c, pool_r, unit, table, pos)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
  assert np.isneginf(got.m[0]).all() and (got.l[0] == 0).all()   # row 0 sees nothing


def test_slot_split_paged_attention_matches_one_device():
  """Pages split by sequence (split="slot", a batch that fills the mesh): slot b's pages
  are ids of shard b // (B / 8); each shard attends its own slots, nothing combined."""
  mesh = make_mesh(parse_mesh("expert:4,fsdp:2"))
  b, h, r, pr, page, m, per = 16, 2, 8, 4, 4, 5, 12
  n = 8 * per
  rng = np.random.default_rng(0)
  pos = rng.integers(0, m * page + 1, size=b).astype(np.int32)
  pos[0], pos[1] = 0, m * page                         # nothing cached / every column
  table = np.zeros((b, m), np.int32)
  for i in range(b):
    shard = i // (b // 8)
    ids = shard * per + 1 + rng.permutation(per - 1)[:m]   # local id 0 left out: the null page
    cols = -(-int(pos[i]) // page)
    table[i, :cols] = ids[:cols]
  k = jax.random.split(jax.random.key(1), 4)
  pool_c = jax.random.normal(k[0], (2, n, page, r))
  pool_r = fold_pages(jax.random.normal(k[1], (2, n, page, pr)))
  q_lat, q_rope = jax.random.normal(k[2], (b, h, r)), jax.random.normal(k[3], (b, h, pr))
  unit = jnp.int32(1)
  want = paged_attention(q_lat, q_rope, pool_c, pool_r, unit, table, pos, 0.3)
  split = NamedSharding(mesh, P(None, paged.page_axes(mesh), None, None))
  pool_c, pool_r = jax.device_put(pool_c, split), jax.device_put(pool_r, split)
  fn = jax.jit(lambda *a: paged.paged_attention(mesh, *a, 0.3, 2, split="slot"))
  got = fn(q_lat, q_rope, pool_c, pool_r, unit, table, pos)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
  assert np.isneginf(got.m[0]).all() and (got.l[0] == 0).all()   # row 0 sees nothing
  hlo = fn.lower(q_lat, q_rope, pool_c, pool_r, unit, table, pos).compile().as_text()
  assert "all-reduce" not in hlo                                 # no combine across shards
  with pytest.raises(ValueError, match="divisible by the 8 page shards"):
    paged.paged_attention(mesh, q_lat[:12], q_rope[:12], pool_c, pool_r, unit, table[:12],
                          pos[:12], 0.3, 2, split="slot")


@pytest.mark.slow   # ~40 s of compiles each (suite budget); the op alone: the test above
@pytest.mark.parametrize("groups", [1, 2])
def test_batch_filling_decode_layout_matches_one_device(groups):
  """The decode layout for a batch that fills the mesh (k3_jax/compile.py): 8 slots on
  expert:8, pages by slot (slot b's pages on shard b), weights split off the model
  dimension (weights_by_output), the experts' all-to-all at the rule's capacity; the
  serving decode step's logits equal one device's to 1e-5, and the idle slots' KDA states
  come back unchanged (kept per layer: KDAState.active). groups=2: the token groups of a
  large batch (partitioning.token_groups, forced here at 8 rows): the mesh viewed as
  [2, 4], each group's 4 tokens against weights split over its 4 devices, the [H, K]
  outputs on H (4 heads here, so that 4 devices divide them: partitioning.grouped_heads)."""
  from k3_jax import compile as comp
  from k3_jax import train
  from k3_jax.config import apply_overrides, validate
  from k3_jax.model import create_model
  from k3_jax.serve import kv_pages as kv
  from k3_jax.serve import steps
  from k3_jax.serve.kv_pages import PAGE
  from k3_jax.execution import Kernels
  from sharding.install import parallel_for
  from sharding.rules import tree_shardings
  from tests.serve.test_engine import tiny_serving_config
  mesh = make_mesh(parse_mesh("expert:8"))
  cfg = tiny_serving_config()
  if groups > 1:
    cfg = validate(apply_overrides(cfg, ["kda.num_heads=4", "mla.num_heads=4"]))
  b, per, m = 8, 3, 2
  cap = comp.decode_ep_capacity(b, mesh, cfg)
  g, p, r = train.split_model(create_model(cfg, seed=3))
  n = 8 * per
  rng = np.random.default_rng(2)
  pos = rng.integers(1, m * PAGE, size=b).astype(np.int32)
  table = np.zeros((b, m), np.int32)
  for i in range(b):                                   # slot i: pages of shard i (not 0)
    table[i] = i * per + 1 + rng.permutation(per - 1)[:m]
  cache = jax.eval_shape(lambda: create_model(cfg, mode="abstract").init_paged_cache(b, n, PAGE))
  shapes = cache

  def fresh():                                         # the decode donates cache and counts
    k = iter(jax.random.split(jax.random.key(4), 64))
    return jax.tree.map(lambda a: (0.3 * jax.random.normal(next(k), a.shape)).astype(a.dtype)
                        if jnp.issubdtype(a.dtype, jnp.floating)
                        else jnp.zeros(a.shape, a.dtype), shapes)
  cache = fresh()
  v = cfg.vocab_size
  z, zf = np.zeros(b, np.int32), np.zeros(b, np.float32)
  sampling = steps.Sampling(z, z, zf, np.ones(b, np.float32), zf, zf, np.zeros((b, v), np.float32))
  active = np.arange(b) < 6                            # slots 6, 7 idle: states kept
  batch = steps.DecodeBatch(rng.integers(1, 256, b).astype(np.int32), pos, table,
                            active, sampling, z, np.zeros(b, bool))
  counts = lambda: jnp.zeros((b, v), jnp.int32)
  one = steps.jit_steps(g, parallel_for(None)).decode(p, r, cache, counts(), batch)[0].logits
  ps = jax.device_put(p, comp.weights_by_output(p, mesh, b, groups))
  rs = jax.device_put(r, tree_shardings(r, mesh))
  cs = jax.device_put(fresh(), kv.paged_cache_shardings(shapes, mesh))
  par = parallel_for(mesh, "slot", Kernels(ep_capacity=cap), groups)
  assert par.token_groups == groups
  got = steps.jit_steps(g, par).decode(ps, rs, cs, counts(), batch)
  np.testing.assert_allclose(np.asarray(got[0].logits), np.asarray(one), atol=1e-5, rtol=0)
  # each KDA layer kept the idle slots' state and windows exactly, and moved the others'
  old = kv.kda_states(fresh())
  for e, o in zip(jax.tree.leaves(kv.kda_states(got[1])), jax.tree.leaves(old)):
    e, o = np.asarray(e), np.asarray(o)
    axis = 1 if e.ndim == o.ndim and e.shape[0] != b else 0         # stacked units: [R, B]
    np.testing.assert_array_equal(np.take(e, [6, 7], axis), np.take(o, [6, 7], axis))
    assert not np.array_equal(np.take(e, [0], axis), np.take(o, [0], axis))
