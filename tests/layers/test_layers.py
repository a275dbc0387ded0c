"""Layers: step-by-step decode equals the full forward; MoE layer equals a dense reference."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
from k3_jax.config import apply_overrides
from k3_jax.layers.init import Init
from k3_jax.layers.kda import KDA
from k3_jax.layers.mla import MLA
from k3_jax.layers.moe import MoE
from k3_jax.ops import moe as moe_ops

CFG = configs.get("k3_tiny")
KIMI_LIKE = apply_overrides(CFG, ["kda.decay=softplus", "kda.gate_rank=8", "kda.decay_rank=8",
                                  "mla.q_lora_rank=0", "mla.output_gate=false"])


def _x(t, seed=0, b=2):
  return jax.random.normal(jax.random.key(seed), (b, t, CFG.d_model), jnp.float32)


@pytest.mark.parametrize("cfg", [CFG, KIMI_LIKE], ids=["k3", "kimi_linear"])
def test_kda_layer_decode_equals_forward(cfg):
  layer = KDA(cfg, init=Init(0))
  run = nnx.jit(lambda l, x, c: l(x, cache=c))
  x = _x(19)
  full, _ = nnx.jit(lambda l, x: l(x))(layer, x)
  # Prefill 7 tokens (chunked form with a cache), then one recurrent step per token.
  y, cache = run(layer, x[:, :7], layer.init_cache(2))
  outs = [y]
  for t in range(7, 19):
    y, cache = run(layer, x[:, t:t + 1], cache)
    outs.append(y)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cfg", [CFG, KIMI_LIKE], ids=["gated_qlora", "kimi_linear"])
def test_mla_layer_absorbed_decode_equals_forward(cfg):
  layer = MLA(cfg, init=Init(1))
  run = nnx.jit(lambda l, x, c, p: l(x, cache=c, pos=p))
  x = _x(13, seed=1)
  full, _, max_full = nnx.jit(lambda l, x: l(x))(layer, x)
  y, cache, _ = run(layer, x[:, :5], layer.init_cache(2, 16), 0)
  outs = [y]
  for t in range(5, 13):
    y, cache, _ = run(layer, x[:, t:t + 1], cache, t)
    outs.append(y)
  # The absorbed form multiplies W_kvb into the query instead of the keys: same math,
  # different summation order (f32): ~1e-6 relative.
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-4, atol=1e-5)
  assert max_full.shape == (cfg.mla.num_heads,)


def test_mla_kv_b_read_from_the_layer_stack_equals_its_slice():
  """The node decode's kv_b (model._held_whole: only where the batch fills the mesh) reaches
  MLA as the whole stack with the unit's index; each half read from it in place equals the
  scan's slice, exactly."""
  from k3_jax.model import _held_whole, _packed_routed
  from k3_jax.ops.mx_gmm import StackedLayer
  from k3_jax.partitioning import SINGLE, SLOT_KEY, Parallel
  assert _held_whole(SINGLE) is _packed_routed
  assert _held_whole(Parallel(key=SLOT_KEY))(("mixer", "kv_b", "w"), None)
  layer = MLA(CFG, init=Init(1))
  w = layer.kv_b.w[...]
  stack = jnp.stack([w * 2, w, w * 3])
  q_nope = jax.random.normal(jax.random.key(0), (2, 1, CFG.mla.num_heads,
                                                 CFG.mla.qk_nope_head_dim))
  q_rope = jnp.ones((2, 1, CFG.mla.num_heads, CFG.mla.qk_rope_head_dim))
  want = layer._absorb_query(q_nope, q_rope)
  layer.kv_b.w.set_value(StackedLayer(stack, jnp.int32(1)))
  got = jax.jit(lambda a, b: layer._absorb_query(a, b))(q_nope, q_rope)
  for g, x in zip(got, want):
    np.testing.assert_array_equal(g, x)


def test_mla_cache_holds_only_latents():
  layer = MLA(CFG, init=Init(1))
  cache = layer.init_cache(1, 8)
  per_token = sum(v.shape[-1] for v in jax.tree.leaves(cache))
  assert per_token == CFG.mla.kv_lora_rank + CFG.mla.qk_rope_head_dim


def test_moe_layer_equals_dense_reference():
  layer = MoE(CFG, init=Init(2))
  x = _x(9, seed=2)
  y, aux = layer(x)
  m = CFG.moe
  xf = x.reshape(-1, CFG.d_model)
  scores = moe_ops.router_scores(xf, layer.router[...])
  w, ids = moe_ops.select_experts(scores, layer.bias[...], m.top_k, m.routed_scaling_factor)
  z = layer.down(xf)
  u = moe_ops.moe_dense_reference(z, w, ids, layer.w_gate[...], layer.w_up[...],
                                  layer.w_down[...], activation="situ")
  ref = layer.up(layer.norm(u)) + layer.shared(xf)
  np.testing.assert_allclose(y.reshape(-1, CFG.d_model), ref, rtol=1e-4, atol=1e-5)
  assert int(aux["expert_load"].sum()) == xf.shape[0] * m.top_k


def test_moe_bias_changes_routing_not_weights():
  layer = MoE(CFG, init=Init(3))
  x = _x(5, seed=3)
  y0, load0 = layer(x)
  layer.bias[...] = jnp.zeros_like(layer.bias[...]).at[0].set(10.0)   # force expert 0
  y1, load1 = layer(x)
  assert int(load1["expert_load"][0]) == x.shape[0] * x.shape[1]
  assert not np.allclose(y0, y1)


def test_router_bias_is_not_a_param():
  layer = MoE(CFG, init=Init(4))
  params = nnx.state(layer, nnx.Param)
  assert "bias" not in params
