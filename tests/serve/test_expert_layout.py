"""The routed experts' serve-time layout (serve/expert_layout.py): on one CPU device every
plain MoE layer gains its experts' gate and up weights side by side (ops/moe.stack_gate_up,
a scanned layer's stack included), the parameters themselves untouched; building it again
changes nothing; `off()` builds none. What the decode computes from it: tests/ops/
test_moe.py (the loops vs the dense reference, rows kept apart) and
test_batch_invariance.py (bitwise logits across batches and slots through an engine that
serves it)."""

import numpy as np
from flax import nnx

from k3_jax import train
from k3_jax.model import create_model
from k3_jax.ops.moe import stack_gate_up
from k3_jax.serve import expert_layout
from tests.serve.test_engine import tiny_serving_config


def test_gate_up_layout_added_once_beside_the_weights():
  cfg = tiny_serving_config()
  g, p, r = train.split_model(create_model(cfg, seed=3))
  with expert_layout.off():
    assert expert_layout.with_gate_up(cfg, g, p, r) == (g, p, r)
  g2, p2, r2 = expert_layout.with_gate_up(cfg, g, p, r)
  layers = nnx.merge(g2, p2, r2).moe_layers()
  assert layers and all(hasattr(moe, "gate_up") for moe, _ in layers)
  for moe, _ in layers:
    want = stack_gate_up(moe.w_gate[...], moe.w_up[...])
    assert np.array_equal(np.asarray(moe.gate_up[...]), np.asarray(want))
  same = lambda a, b: all(x is y for x, y in zip(*(nnx.to_flat_state(t).leaves for t in (a, b))))
  assert same(p, p2)                                  # the parameters are shared, not copied
  again = expert_layout.with_gate_up(cfg, g2, p2, r2)
  assert again[0] == g2 and again[1] is p2 and again[2] is r2
