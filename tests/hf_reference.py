"""Helpers for comparisons with Hugging Face transformers' KimiLinearForCausalLM (the parity
tests): weights redrawn at scales where every path matters. Needs torch (a test
dependency)."""

from __future__ import annotations

import math

import torch
import transformers


def redraw(model, seed: int = 0) -> None:
  """Redraws `model`'s weights in place (the HF init, std 0.02, nearly zeroes every path):
  A_log as log U(1, 16), dt_bias around -2, norm gains near 1, a sharp router (uneven
  routing), conv taps at 0.5 std, matrices at 1/sqrt(fan_in), and random expert-score
  correction biases."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("A_log"):
        p.copy_(torch.empty_like(p).uniform_(1.0, 16.0, generator=g).log())
      elif name.endswith("dt_bias"):
        p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 2.0)
      elif p.ndim == 1:                                   # norm gains
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
      elif "gate.weight" in name:                         # router: sharp, uneven scores
        p.copy_(torch.randn(p.shape, generator=g) * 2.0 / math.sqrt(p.shape[-1]))
      elif "conv1d" in name:
        p.copy_(torch.randn(p.shape, generator=g) * 0.5)
      else:
        p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(torch.randn(b.shape, generator=g) * 0.3)


def kimi_linear_config(*, vocab: int, d: int, dense: int, expert: int, layers: int, heads: int,
                       kv_lora: int, rope: int, nope: int, v: int, experts: int, top_k: int,
                       kda_heads: int, kda_dim: int, full_attn_layers: list[int],
                       **extra) -> transformers.KimiLinearConfig:
  """transformers' KimiLinearConfig for a test or benchmark model: the first layer dense,
  the rest MoE with one shared expert; KDA in every layer (1-based) not in
  full_attn_layers; no query low rank; no special token ids."""
  kda_layers = [i for i in range(1, layers + 1) if i not in full_attn_layers]
  return transformers.KimiLinearConfig(
      vocab_size=vocab, hidden_size=d, intermediate_size=dense, moe_intermediate_size=expert,
      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
      kv_lora_rank=kv_lora, q_lora_rank=None, qk_rope_head_dim=rope, qk_nope_head_dim=nope,
      v_head_dim=v, num_experts=experts, num_experts_per_token=top_k, n_shared_experts=1,
      routed_scaling_factor=2.446,
      linear_attn_config={"num_heads": kda_heads, "head_dim": kda_dim,
                          "short_conv_kernel_size": 4, "kda_layers": kda_layers,
                          "full_attn_layers": list(full_attn_layers)},
      first_k_dense_replace=1, pad_token_id=None, bos_token_id=None, eos_token_id=None, **extra)

