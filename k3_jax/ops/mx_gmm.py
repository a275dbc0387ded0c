"""Grouped matmuls with MX-format routed experts (docs/architecture.md section 7): the plain-JAX
reference of the MXFP4 kernel, and the MoE layer's QAT / packed grouped-matmul hooks.

What is quantized (everything else stays in the model's dtype):
- routed-expert weights w_gate, w_up [E, L, F] and w_down [E, F, L] -> MXFP4, blocks of 32
  along the contraction axis (axis -2 of each: L for gate/up, F for down);
- the activations entering each routed-expert matmul (the latent rows z before gate/up, the
  GLU hidden h before down) -> MXFP8 E4M3, blocks of 32 along their last (contraction) axis.
  Project choice: both matmul inputs of the expert, as MX hardware consumes them.

Training (`quant.qat = "mxfp4_mxfp8"`) fake-quantizes both (straight-through gradients):
`qat_weight`, `qat_gmm`. Serving converts the trained weights once to `MXArray`s
(`pack_weight`; the model-level tools are in k3_jax/serve/pack.py, 4.25 bits per weight in
memory) and the MoE layer runs `packed_gmm`, which dequantizes each expert's weights inside
the grouped matmul; it computes the same values as the QAT forward, since
dequantize(quantize(w)) is what QAT multiplies with. On TPU, where the grouped matmul runs
on local arrays, the Pallas kernel that reads the packed codes directly
(pallas_kernels/mxfp4_gmm.py) takes its place (`packed_gmm(..., kernel=True)`).

The reference:

`mxfp4_gmm(lhs, rhs, group_sizes)` has the semantics of the Pallas kernel
`pallas_kernels.mxfp4_gmm.mxfp4_gmm` (same signature, minus the kernel's tiling and
interpret options): dequantize, then `jax.lax.ragged_dot`.

    lhs          [M, L] float, or an MXFP8 MXArray ("mxfp8_e4m3" / "mxfp8_e5m2", axis -1)
    rhs          MXFP4 MXArray of logical shape [E, L, F], blocked along L (axis 1 / -2):
                 codes [E, L/2, F] uint8, scales [E, L/32, F] uint8
    group_sizes  [E] int; rows grouped contiguously by expert, sum <= M
    returns      [M, F] in preferred_element_type (default: the lhs dtype; BF16 for MXFP8);
                 rows past sum(group_sizes) are 0

Both operands enter the matmul as BF16 with a float32 result, as on the MXU: dequantized
MX values are exact in BF16 (E2M1 has 2 significant bits, E4M3 4, E5M2 3, times a power
of two), while a float32 lhs is rounded to BF16 here exactly as the kernel rounds it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from k3_jax.ops.moe import GroupedMatmul
from k3_jax.ops.mx import MXArray, dequantize, fake_quantize, quantize

WEIGHT_FMT = "mxfp4"
ACT_FMT = "mxfp8_e4m3"
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")     # the MoE layer's routed-expert weights
WEIGHT_AXIS = -2        # contraction axis of [.., E, L, F] and [.., E, F, L] expert weights


def mxfp4_gmm(lhs: jax.Array | MXArray, rhs: MXArray, group_sizes: jax.Array, *,
              preferred_element_type=None) -> jax.Array:
  """Reference grouped matmul lhs [M, L] x dequantize(rhs) [E, L, F] -> [M, F]."""
  if not isinstance(rhs, MXArray) or rhs.fmt != "mxfp4" or rhs.codes.ndim != 3 or \
     rhs.axis not in (1, -2):
    raise ValueError("rhs must be an 'mxfp4' MXArray of shape [E, L, F] blocked along L "
                     f"(axis 1); got {type(rhs).__name__}"
                     + (f" fmt={rhs.fmt!r} axis={rhs.axis}" if isinstance(rhs, MXArray) else ""))
  if isinstance(lhs, MXArray):
    if not lhs.fmt.startswith("mxfp8") or lhs.axis not in (1, -1):
      raise ValueError(f"an MX lhs must be MXFP8 blocked along its last axis; got "
                       f"fmt={lhs.fmt!r} axis={lhs.axis}")
    x = dequantize(lhs, jnp.bfloat16)                                   # [M, L]
    out_dtype = preferred_element_type or jnp.bfloat16
  else:
    x = lhs.astype(jnp.bfloat16)                                        # [M, L]
    out_dtype = preferred_element_type or lhs.dtype
  w = dequantize(rhs, jnp.bfloat16)                                     # [E, L, F]
  out = jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32),
                           preferred_element_type=jnp.float32)          # [M, F]
  return out.astype(out_dtype)


def qat_weight(w: jax.Array, dtype) -> jax.Array:
  """A routed-expert weight as QAT sees it: MXFP4 fake-quantized along its contraction axis
  (from the master weight), then cast to the compute dtype (exact: E2M1 x 2^k fits BF16)."""
  return fake_quantize(w, WEIGHT_FMT, WEIGHT_AXIS).astype(dtype)


def qat_gmm(base: GroupedMatmul) -> GroupedMatmul:
  """Grouped matmul whose lhs rows are MXFP8 (E4M3) fake-quantized along the contraction
  axis first; the rhs is passed through (already fake-quantized by `qat_weight`)."""
  def gmm(lhs, rhs, group_sizes):
    return base(fake_quantize(lhs, ACT_FMT, -1), rhs, group_sizes)
  return gmm


@dataclasses.dataclass(frozen=True)
class StackedLayer:
  """Layer `index` of a stacked (scanned) packed expert weight, not sliced out of the stack.

  Under the layer scan a weight arrives as the scan's slice of the stack, and XLA copies a
  slice that feeds a Pallas call (its operand must be a whole buffer): every local expert
  of the layer, read and written, in every layer of every step. The model's scan passes the
  routed experts' stacks this way instead (model.py); the MXFP4 kernel reads the layer
  through its index map (`layer=`), everything else takes `value()`, the same slice."""
  stack: MXArray             # [layers, E, ...] packed
  index: jax.Array           # int32 scalar

  @property
  def shape(self) -> tuple[int, ...]:
    return self.stack.shape[1:]

  def value(self) -> MXArray:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.index, 0, False),
                        self.stack)


jax.tree_util.register_dataclass(StackedLayer, data_fields=["stack", "index"], meta_fields=[])


def unstacked(w):
  """A weight as an array (StackedLayer -> its layer's slice; anything else as is)."""
  return w.value() if isinstance(w, StackedLayer) else w


def packed_gmm(base: GroupedMatmul, kernel: bool = False) -> GroupedMatmul:
  """Grouped matmul over a packed MXFP4 rhs (MXArray [E, K, N] blocked along K): the lhs is
  MXFP8 fake-quantized as in QAT, the rhs dequantized to the lhs dtype, then `base`.

  kernel=True: the TPU Pallas kernel instead (pallas_kernels/mxfp4_gmm.py: it reads the
  packed codes from HBM and dequantizes tiles in VMEM; the lhs quantized to MXFP8 E4M3 in
  the kernel, per tile in VMEM (`lhs_quant`), the same values). Its `gated` attribute
  computes an expert FFN's gated hidden glu(lhs @ w_gate, lhs @ w_up) in one call (the
  expert-parallel dispatch takes it where present: sharding/expert.py `_gated`). The
  caller passes it only where the call runs on whole local arrays (one device,
  or inside the expert-parallel shard_map), since a Mosaic kernel cannot be partitioned."""
  if kernel:
    from pallas_kernels.mxfp4_gmm import mxfp4_gmm as kernel_mxfp4_gmm  # lazy: TPU serving

    def kernel_gmm(lhs, rhs: MXArray | StackedLayer, group_sizes):
      stacked = isinstance(rhs, StackedLayer)
      # the lhs quantised to MXFP8 inside the kernel, per tile in VMEM: bitwise the
      # values quantize(lhs, ACT_FMT, -1) gives, without its passes over the buffer
      return kernel_mxfp4_gmm(lhs, rhs.stack if stacked else rhs, group_sizes,
                              preferred_element_type=lhs.dtype,
                              layer=rhs.index if stacked else None, lhs_quant=ACT_FMT)

    def gated(lhs, w_gate, w_up, group_sizes, activation, beta1, beta2):
      """glu(gmm(lhs, w_gate), gmm(lhs, w_up)) in one kernel call (`rhs_up`, `glu`): the
      lhs read and quantised once for both, neither product written to HBM."""
      stacked = isinstance(w_gate, StackedLayer)
      return kernel_mxfp4_gmm(lhs, w_gate.stack if stacked else w_gate, group_sizes,
                              preferred_element_type=lhs.dtype,
                              layer=w_gate.index if stacked else None, lhs_quant=ACT_FMT,
                              rhs_up=w_up.stack if stacked else w_up,
                              glu=(activation, beta1, beta2))
    kernel_gmm.gated = gated
    return kernel_gmm

  def gmm(lhs, rhs: MXArray | StackedLayer, group_sizes):
    return base(fake_quantize(lhs, ACT_FMT, -1), dequantize(unstacked(rhs), lhs.dtype),
                group_sizes)
  return gmm


def pack_weight(w: jax.Array) -> MXArray:
  """One routed-expert weight (any leading axes, e.g. stacked layers) -> packed MXFP4."""
  return quantize(w, WEIGHT_FMT, WEIGHT_AXIS)


__all__ = ["mxfp4_gmm", "WEIGHT_FMT", "ACT_FMT", "EXPERT_WEIGHTS", "WEIGHT_AXIS",
           "qat_weight", "qat_gmm", "packed_gmm", "pack_weight", "MXArray", "StackedLayer",
           "unstacked"]
