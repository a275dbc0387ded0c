"""Helpers for comparisons with Hugging Face transformers' KimiLinearForCausalLM (the parity
tests): weights redrawn at scales where every path matters. Needs torch (a test
dependency)."""

from __future__ import annotations

import math

import torch


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
