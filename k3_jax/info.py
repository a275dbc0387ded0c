"""What `info` reports, computed abstractly (nothing is allocated, so it works for k3):
the layer plan and parameter counts, serving bytes with MXFP4 experts, and every
parameter's optimizer group."""

from __future__ import annotations

from flax import nnx

from k3_jax import stack
from k3_jax.config import ModelConfig
from k3_jax.model import abstract_model, param_counts, vision_param_counts
from k3_jax.optim.muon import ADAMW, param_groups
from k3_jax.serve.pack import serving_weight_bytes


def model_summary(cfg: ModelConfig, serving_bytes: bool = False,
                  vision_cfg: ModelConfig | None = None) -> dict:
  """Layer pattern (K = KDA, M = MLA, d = dense FFN), scan plan, total / activated / per-module
  parameter counts; with serving_bytes, also the bytes served with the routed experts packed
  MXFP4 and the rest BF16 (key "serving_mxfp4"); with vision_cfg (the preset with its tower),
  the tower's counts on their own ("vision_params", "vision_by_module", not in the totals)."""
  plan = stack.plan_of(cfg)
  pattern = "".join(("K" if l.mixer == "kda" else "M") + ("d" if l.ffn == "dense" else "")
                    for l in plan.layers)
  out = {"config": cfg.name, "layers": cfg.num_layers,
         "kda_layers": sum(l.mixer == "kda" for l in plan.layers),
         "mla_layers": [l.index + 1 for l in plan.layers if l.mixer == "mla"],
         "layer_pattern": pattern,
         "scan": {"unscanned_prefix": plan.prefix, "repeats": plan.repeats,
                  "period": plan.period, "unscanned_suffix": len(plan.group("suffix"))},
         **param_counts(cfg)}
  if vision_cfg is not None and vision_cfg.vision is not None:
    out.update(vision_param_counts(vision_cfg))
  if serving_bytes:
    out["serving_mxfp4"] = serving_weight_bytes(cfg)
  return out


def optimizer_groups(cfg: ModelConfig, optimizer: str) -> list[tuple[str, tuple, object]]:
  """(path, shape, group) of every parameter: its optimizer group (per-head Muon,
  per-expert Muon, Muon, AdamW) and batch axes under `optimizer` ("muon" | "adamw")."""
  rows = param_groups(nnx.state(abstract_model(cfg), nnx.Param))
  if optimizer == "adamw":
    rows = [(n, s, type(g)(ADAMW)) for n, s, g in rows]
  return rows
