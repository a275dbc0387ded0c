"""Small model configs shared by the checkpoint tests."""

import configs
from k3_jax.config import apply_overrides


def kimi_linear_small():
  """A small kimi_linear config (the parity test's shape, our side)."""
  return apply_overrides(configs.get("kimi_linear_48b"), [
      "vocab_size=128", "d_model=64", "num_layers=4", "mla_layers=4", "dense_intermediate=96",
      "dtype=float32", "param_dtype=float32", "kda.num_heads=2", "kda.head_dim=16",
      "kda.gate_rank=16", "kda.decay_rank=16", "mla.num_heads=2", "mla.kv_lora_rank=16",
      "mla.qk_nope_head_dim=16", "mla.qk_rope_head_dim=8", "mla.v_head_dim=16",
      "moe.num_experts=8", "moe.top_k=2", "moe.expert_intermediate=32", "max_seq_len=512"])


def k3_tiny_mx():
  """k3_tiny with expert widths that MXFP4 can hold (multiples of 32)."""
  return apply_overrides(configs.get("k3_tiny"), ["moe.latent_dim=32",
                                                  "moe.expert_intermediate=32"])
