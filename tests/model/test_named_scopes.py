"""Every layer and the blocks inside it run under a `jax.named_scope`, so a profile (or the
HLO) reads by name: the op names of a tiny model's lowered forward carry the scopes."""

import re

import jax
import jax.numpy as jnp
from flax import nnx

import configs
from k3_jax.config import apply_overrides
from k3_jax.model import create_model, forward

# One scanned unit of [KDA+dense, KDA+MoE, KDA+MoE, MLA+MoE] and one trailing MLA layer.
CFG = apply_overrides(configs.get("k3_tiny"), ["num_layers=5", "mla_layers=(4,5)"])

SCOPES = ("embed", "units", "unit_layer_0", "unit_layer_3", "layer_4", "lm_head",
          "mixer/kda/projections", "mixer/kda/conv", "mixer/kda/decay", "mixer/kda/chunk",
          "mixer/kda/output", "mixer/mla/projections", "mixer/mla/attention",
          "mixer/mla/output", "ffn/dense_ffn", "ffn/moe/router", "ffn/moe/routed_experts/dispatch",
          "ffn/moe/routed_experts/experts", "ffn/moe/routed_experts/combine",
          "ffn/moe/shared_experts", "attn_res")


def test_lowered_forward_names_its_layers_and_blocks():
  assert CFG.stack_plan() == (0, 1, 4)
  graphdef, state = nnx.split(create_model(CFG, seed=0))
  tokens = jnp.zeros((2, 40), jnp.int32)     # 80 tokens: the dispatch path, not moe_small
  text = jax.jit(lambda s, t: forward(nnx.merge(graphdef, s), t)).lower(
      state, tokens).as_text(debug_info=True)
  names = ["/" + n + "/" for n in set(re.findall(r'loc\("([^"]+)"', text))]
  missing = [s for s in SCOPES if not any(f"/{s}/" in n for n in names)]
  assert not missing, missing
