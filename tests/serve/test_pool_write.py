"""Where a scanned MLA layer's latents go into the serving pools (model.POOL_WRITES): written
inside each layer with the pools in the scan's carry (XLA:CPU's placement) or scattered
after the scan (the TPU's). On a 3-layer k3_tiny (an MLA layer, then two scanned as two
units of one), a prompt piece that crosses a page boundary and two decode steps on
shuffled pages give the same logits and the same pools both ways (the same values are
written and read; tolerance 0)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from k3_jax.cache import PagedMLACache
from k3_jax.config import apply_overrides, validate
from k3_jax.model import POOL_WRITES, create_model, pool_write_for
from k3_jax.serve import kv_pages as kv
from k3_jax.serve.kv_pages import PAGE
from k3_jax.stack import cache_leaves
from tests.serve.test_engine import OVERRIDES

# k3_tiny as an MLA layer (unscanned) then two MLA layers scanned as two units of one
OVERRIDES_3 = OVERRIDES[:1] + ["num_layers=3", "mla_layers=(1,2,3)", "dense_layers=(1,)",
                               "scan_period=1"]


def test_pool_write_by_platform():
  assert pool_write_for("tpu") == "after_scan"
  assert pool_write_for("cpu") == pool_write_for("gpu") == "in_layer"
  assert set(POOL_WRITES) == {"in_layer", "after_scan"}


def run(model, pool_write):
  """Logits of a 6-token piece at positions [PAGE - 4, 3] (slot 0 crosses into its second
  page) then two decode steps, and the final pools."""
  table = jnp.asarray([[3, 1], [4, 2]], jnp.int32)
  cache = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: model.init_paged_cache(2, 5, PAGE)))
  call = jax.jit(lambda c, t, pos: model(t, cache=kv.with_pages(c, pos, table),
                                         pool_write=pool_write)[:2])
  rng = np.random.default_rng(0)
  pos = np.array([PAGE - 4, 3], np.int32)
  out = []
  for t in (6, 1, 1):
    tokens = jnp.asarray(rng.integers(1, 256, (2, t)), jnp.int32)
    logits, cache = call(cache, tokens, pos)
    cache = kv.without_pages(cache)
    out.append(np.asarray(logits))
    pos = pos + t
  pools = [np.asarray(a) for e in cache_leaves(cache) if isinstance(e, PagedMLACache)
           for a in (e.c_kv, e.k_r)]
  return out, pools


def test_both_pool_writes_give_the_same_logits_and_pools():
  model = create_model(validate(apply_overrides(configs.get("k3_tiny"), OVERRIDES_3)), seed=3)
  plan = model.plan
  assert plan.repeats == 2 and [s.mixer for s in plan.unit] == ["mla"]
  logits_a, pools_a = run(model, "in_layer")
  logits_b, pools_b = run(model, "after_scan")
  assert len(pools_a) == 4 and pools_a[2].shape[0] == 2             # the stacked pools
  for a, b in zip(logits_a, logits_b):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(pools_a, pools_b):
    np.testing.assert_array_equal(a, b)
  assert all(np.abs(p).sum() > 0 for p in pools_a)
  with pytest.raises(ValueError, match="pool_write='elsewhere'"):
    run(model, "elsewhere")
