"""The roofline's count of the matmul forms the TPU compiler writes for MoE training (a
grouped matmul as a Pallas/Mosaic custom call with a cost estimate, a per-group weight
gradient as a dilated convolution) against hand counts, and the per-scope attribution of
FLOPs, bytes and collectives by op_name (k3_jax/step_costs.py)."""

import pytest

import configs
from k3_jax import step_costs
from pod import roofline

# Shapes of the k3 program's forms, small: G=4 groups, M=64 rows, K=8, N=16.
G, M, K, N = 4, 64, 8, 16
_META = 'metadata={op_name="%s"}'

HLO = f"""HloModule m

ENTRY %main (p0: bf16[{G},{M},{K}], p1: f32[{G},{M},{N}], p2: bf16[{M},{K}], p3: bf16[{G},{K},{N}], p4: s32[{G}]) -> (bf16[{G},{K},{N}], f32[{M},{N}], f32[{M},{M}]) {{
  %p0 = bf16[{G},{M},{K}]{{2,1,0}} parameter(0)
  %p1 = f32[{G},{M},{N}]{{2,1,0}} parameter(1)
  %p2 = bf16[{M},{K}]{{1,0}} parameter(2)
  %p3 = bf16[{G},{K},{N}]{{2,1,0}} parameter(3)
  %p4 = s32[{G}]{{0}} parameter(4)
  %conv = bf16[{G},{K},{N}]{{2,1,0}} convolution(%p0, %p1), window={{size={G} stride={G - 1} lhs_dilate={G}}}, dim_labels=0fb_0io->0bf, {_META % "jit(step)/transpose(jvp(units))/while/body/closed_call/checkpoint/unit_layer_0/ffn/moe/routed_experts/shard_map/experts/ragged_dot"}
  %gmm = f32[{M},{N}]{{1,0}} custom-call(%p4, %p2, %p3), custom_call_target="tpu_custom_call", {_META % "jit(step)/jvp(units)/while/body/closed_call/unit_layer_0/ffn/moe/routed_experts/shard_map/experts/ragged-dot-none"}, backend_config={{"custom_call_config":{{"cost_estimate":{{"flops":"{2 * M * K * N}","transcendentals":"0","bytes_accessed":"4096"}}}}}}
  %dot = f32[{M},{M}]{{1,0}} dot(%p2, %p2), lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}, {_META % "jit(step)/transpose(jvp(units))/while/body/closed_call/checkpoint/rematted_computation/unit_layer_0/mixer/mla/q_b/dot_general"}
  ROOT %t = (bf16[{G},{K},{N}]{{2,1,0}}, f32[{M},{N}]{{1,0}}, f32[{M},{M}]{{1,0}}) tuple(%conv, %gmm, %dot)
}}
"""


def test_dilated_convolution_counts_one_matmul_per_group():
  """The weight gradient of a grouped matmul as the TPU compiler writes it: the groups as
  a spatial dimension with lhs_dilate = window = G and stride G - 1, so output g meets
  only input g (the other taps fall on the dilation's holes): G matmuls [K, M] x [M, N],
  2 G M K N FLOPs, not G^2 of them."""
  w = roofline._Walker(HLO)
  conv = w.comps["main"]["conv"]
  lhs, rhs = w.shape("main", "p0")[0][1], w.shape("main", "p1")[0][1]
  assert roofline._conv_flops(lhs, rhs, (G, K, N), conv.attrs) == 2 * G * M * K * N


def test_grouped_matmul_custom_call_counted_from_its_estimate_and_scoped():
  """The whole program: the conv (2 G M K N), the Mosaic grouped matmul from its cost
  estimate (2 M K N) and a plain dot (2 M K M), each under its scope and phase."""
  costs = roofline.program_costs(HLO, scope_of=step_costs.scope_of)
  conv, gmm, dot = 2 * G * M * K * N, 2 * M * K * N, 2 * M * K * M
  assert costs.flops == conv + gmm + dot
  parts = step_costs.by_part(costs.scopes)
  assert parts["moe_experts"]["phases"]["backward"]["flops"] == conv
  assert parts["moe_experts"]["phases"]["forward"]["flops"] == gmm
  assert parts["mla_projections"]["phases"]["recompute"]["flops"] == dot
  assert sum(p["flops"] for p in parts.values()) == costs.flops
  assert sum(p["hbm_bytes"] for p in parts.values()) == pytest.approx(costs.hbm_bytes)


@pytest.mark.parametrize("name,opcode,want", [
    ("jit(train_step)/optimizer/while/body/dot_general", "dot", "optimizer:update"),
    ("jit(train_step)/jvp(layer_0)/mixer/kda/chunk/shard_map/x", "fusion", "kda_core:forward"),
    ("jit(train_step)/jvp(units)/while/body/closed_call/unit_layer_1/ffn/moe/routed_experts/"
     "expert_parallel/shard_map/ragged_all_to_all", "all-to-all", "moe_dispatch_combine:forward"),
    ("jit(train_step)/transpose(jvp(lm_head))/btd,dv->btv/dot_general", "dot",
     "lm_head:backward"),
    ("", "convolution", "other:forward"),
])
def test_scope_of(name, opcode, want):
  assert step_costs.scope_of(name, opcode) == want


def test_analytic_parts_add_up_to_six_n():
  """Without remat the analytic parts (attention cores aside) are 6 x the activated
  parameters per token, within the parameters they leave out (norms, convs, biases,
  gates' small matrices): 5%."""
  from k3_jax.model import param_counts
  cfg = configs.get("k3")
  parts = step_costs.analytic_flops(cfg, tokens=4096, seq_len=4096, chips=1)
  matmuls = sum(v for k, v in parts.items() if k not in ("mla_attention_core", "kda_core"))
  want = 6 * param_counts(cfg)["active_params"] * 4096
  assert matmuls == pytest.approx(want, rel=0.05)
