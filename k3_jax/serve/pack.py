"""Serving weights with MXFP4 routed experts: pack a model's experts once, and count the
bytes a served model holds (docs/architecture.md section 7).

The per-weight format and the grouped matmuls that read packed weights are layer-level and
live beside the MX ops (k3_jax/ops/mx_gmm.py); this module works on whole models.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3_jax.model import abstract_model
from k3_jax.ops.mx import MXArray
from k3_jax.ops.mx_gmm import EXPERT_WEIGHTS, pack_weight


def pack_moe(moe) -> None:
  """Packs one MoE layer's routed-expert weights (w_gate / w_up / w_down) in place to MXFP4
  MXArrays; the layer's forward then runs from them. Quantizes the master (param dtype)
  weights, as QAT does."""
  for name in EXPERT_WEIGHTS:
    var = getattr(moe, name)
    value = var.get_value()
    if not isinstance(value, MXArray):
      var.set_value(pack_weight(value))


def pack_routed_experts(model) -> None:
  """Packs, in place, every MoE layer of `model` (a K3Model: its `moe_layers()`)."""
  for moe, _ in model.moe_layers():
    pack_moe(moe)


def pack_state(graphdef, params, rest):
  """(graphdef, params, rest) of a model -> the same with routed experts packed to MXFP4
  (for serving: `Engine(cfg, *pack_state(...))`)."""
  model = nnx.merge(graphdef, params, rest)
  pack_routed_experts(model)
  return nnx.split(model, nnx.Param, ...)


def serving_weight_bytes(cfg) -> dict:
  """Bytes of the serving weights, computed abstractly (no allocation): routed experts as
  packed MXFP4 (codes + E8M0 scales), every other parameter in BF16. Returns totals and a
  per-part breakdown (by top-level module, and routed experts separately)."""
  model = abstract_model(cfg)
  routed_ids = set()
  for moe, _ in model.moe_layers():
    for name in EXPERT_WEIGHTS:
      routed_ids.add(id(getattr(moe, name)))
  # Walk the parameters once, classifying by variable identity.
  parts: dict[str, int] = {}
  routed_bytes = routed_params = other_bytes = 0
  for path, var in nnx.iter_graph(model):
    if not isinstance(var, nnx.Param):
      continue
    shape = tuple(var.get_value().shape)
    n = math.prod(shape)
    if id(var) in routed_ids:
      packed = jax.eval_shape(pack_weight, jax.ShapeDtypeStruct(shape, jnp.float32))
      b = math.prod(packed.codes.shape) + math.prod(packed.scales.shape)
      routed_bytes += b
      routed_params += n
      key = "routed_experts"
    else:
      b = 2 * n
      other_bytes += b
      key = str(path[0])
    parts[key] = parts.get(key, 0) + b
  return {"total_bytes": routed_bytes + other_bytes,
          "routed_expert_bytes": routed_bytes,
          "other_bf16_bytes": other_bytes,
          "routed_expert_params": routed_params,
          "bits_per_routed_weight": 8 * routed_bytes / max(routed_params, 1),
          "bf16_total_bytes": 2 * routed_params + other_bytes,
          "by_part": parts}


__all__ = ["pack_moe", "pack_routed_experts", "pack_state", "serving_weight_bytes"]
