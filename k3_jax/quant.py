"""MXFP4 / MXFP8 for the routed experts: QAT grouped matmuls, packed serving weights, and
the serving-weight byte count (K3_SPEC section 7).

What is quantized (everything else stays in the model's dtype):
- routed-expert weights w_gate, w_up [E, L, F] and w_down [E, F, L] -> MXFP4, blocks of 32
  along the contraction axis (axis -2 of each: L for gate/up, F for down);
- the activations entering each routed-expert matmul (the latent rows z before gate/up, the
  GLU hidden h before down) -> MXFP8 E4M3, blocks of 32 along their last (contraction) axis.
  Project choice: both matmul inputs of the expert, as MX hardware consumes them.

Training (`quant.qat = "mxfp4_mxfp8"`) fake-quantizes both (straight-through gradients).
Serving converts the trained weights once to `MXArray`s (`pack_routed_experts`, 4.25 bits per
weight in memory) and the MoE layer runs `packed_gmm`, which dequantizes each expert's
weights inside the grouped matmul; it computes the same values as the QAT forward, since
dequantize(quantize(w)) is what QAT multiplies with. On TPU, where the grouped matmul runs
on local arrays, the Pallas kernel that reads the packed codes directly
(pallas_kernels/mxfp4_gmm.py) takes its place (`packed_gmm(..., kernel=True)`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3_jax.ops import moe as moe_ops
from k3_jax.ops.mx import MXArray, dequantize, fake_quantize, quantize  # noqa: F401 (MXArray re-exported)

WEIGHT_FMT = "mxfp4"
ACT_FMT = "mxfp8_e4m3"
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
WEIGHT_AXIS = -2        # contraction axis of [.., E, L, F] and [.., E, F, L] expert weights


def qat_weight(w: jax.Array, dtype) -> jax.Array:
  """A routed-expert weight as QAT sees it: MXFP4 fake-quantized along its contraction axis
  (from the master weight), then cast to the compute dtype (exact: E2M1 x 2^k fits BF16)."""
  return fake_quantize(w, WEIGHT_FMT, WEIGHT_AXIS).astype(dtype)


def qat_gmm(base: moe_ops.GroupedMatmul) -> moe_ops.GroupedMatmul:
  """Grouped matmul whose lhs rows are MXFP8 (E4M3) fake-quantized along the contraction
  axis first; the rhs is passed through (already fake-quantized by `qat_weight`)."""
  def gmm(lhs, rhs, group_sizes):
    return base(fake_quantize(lhs, ACT_FMT, -1), rhs, group_sizes)
  return gmm


def packed_gmm(base: moe_ops.GroupedMatmul, kernel: bool = False) -> moe_ops.GroupedMatmul:
  """Grouped matmul over a packed MXFP4 rhs (MXArray [E, K, N] blocked along K): the lhs is
  MXFP8 fake-quantized as in QAT, the rhs dequantized to the lhs dtype, then `base`.

  kernel=True: the TPU Pallas kernel instead (pallas_kernels/mxfp4_gmm.py: it reads the
  packed codes from HBM and dequantizes tiles in VMEM; lhs quantized to MXFP8 E4M3, the same
  values). The caller passes it only where the call runs on whole local arrays (one device,
  or inside the expert-parallel shard_map), since a Mosaic kernel cannot be partitioned."""
  if kernel:
    from pallas_kernels.mxfp4_gmm import mxfp4_gmm  # lazy: TPU serving only

    def kernel_gmm(lhs, rhs: MXArray, group_sizes):
      return mxfp4_gmm(quantize(lhs, ACT_FMT, -1), rhs, group_sizes,
                       preferred_element_type=lhs.dtype)
    return kernel_gmm

  def gmm(lhs, rhs: MXArray, group_sizes):
    return base(fake_quantize(lhs, ACT_FMT, -1), dequantize(rhs, lhs.dtype), group_sizes)
  return gmm


def pack_weight(w: jax.Array) -> MXArray:
  """One routed-expert weight (any leading axes, e.g. stacked layers) -> packed MXFP4."""
  return quantize(w, WEIGHT_FMT, WEIGHT_AXIS)


def pack_routed_experts(model) -> None:
  """Replaces, in place, every MoE layer's w_gate / w_up / w_down value with its packed
  MXFP4 MXArray. `model` is a K3Model (its `moe_layers()`); the MoE forward then runs from
  the packed weights. Quantizes the master (param dtype) weights, as QAT does."""
  for moe, _ in model.moe_layers():
    pack_moe(moe)


def pack_moe(moe) -> None:
  """Packs one MoE layer's routed-expert weights in place (see `pack_routed_experts`)."""
  for name in EXPERT_WEIGHTS:
    var = getattr(moe, name)
    value = var.get_value()
    if not isinstance(value, MXArray):
      var.set_value(pack_weight(value))


def serving_weight_bytes(cfg) -> dict:
  """Bytes of the serving weights, computed abstractly (no allocation): routed experts as
  packed MXFP4 (codes + E8M0 scales), every other parameter in BF16. Returns totals and a
  per-part breakdown (by top-level module, and routed experts separately)."""
  from flax import nnx
  from k3_jax.model import abstract_model

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


__all__ = ["WEIGHT_FMT", "ACT_FMT", "EXPERT_WEIGHTS", "qat_weight", "qat_gmm", "packed_gmm",
           "pack_weight", "pack_moe", "pack_routed_experts", "pack_state", "serving_weight_bytes"]


def pack_state(graphdef, params, rest):
  """(graphdef, params, rest) of a model -> the same with routed experts packed to MXFP4
  (for serving: `Engine(cfg, *pack_state(...))`)."""
  from flax import nnx
  model = nnx.merge(graphdef, params, rest)
  pack_routed_experts(model)
  return nnx.split(model, nnx.Param, ...)
