"""Released checkpoint layouts: one module per model family, each describing, for a
ModelConfig, every tensor on disk as an `Entry` (layouts/entry.py) and translating
config.json <-> ModelConfig.

A layout module provides:
  MODEL_TYPE                      the `model_type` its config.json carries
  entries(cfg, **options)         list[Entry] in file order
  config_to_hf(cfg, **options)    the release's config.json (dict)
  config_from_hf(hf: dict)        -> ModelConfig
  check_expressible(cfg)          raises LayoutError naming what the layout cannot hold
"""

from __future__ import annotations

from k3_jax.checkpoint.layouts import kimi_k3, kimi_linear
from k3_jax.checkpoint.layouts.entry import Entry, LayoutError, Tensor

LAYOUTS = {kimi_linear.MODEL_TYPE: kimi_linear, kimi_k3.MODEL_TYPE: kimi_k3}


def by_model_type(model_type: str):
  if model_type not in LAYOUTS:
    raise LayoutError(f"unknown model_type {model_type!r} in config.json; supported: "
                      f"{', '.join(sorted(LAYOUTS))}")
  return LAYOUTS[model_type]


def for_config(cfg):
  """The layout a model config is released in: Kimi-Linear models (softplus KDA decay, no
  Attention Residuals, no latent MoE) as kimi_linear, everything else as kimi_k3."""
  if cfg.kda.decay == "softplus" and not cfg.attn_res.enabled and not cfg.moe.latent_dim:
    return kimi_linear
  return kimi_k3


__all__ = ["Entry", "Tensor", "LayoutError", "LAYOUTS", "by_model_type", "for_config"]
