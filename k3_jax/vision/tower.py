"""MoonViT as Flax NNX modules: patch embedding + interpolated position table, pre-norm blocks
(fused qkv with 2-D RoPE, block-diagonal attention per image, tanh-GELU MLP), final norm,
2 x 2 merge, and the projector into the language model width (docs/architecture.md section 8).

Input: the packed-images dict of k3_jax/ops/vision.py (several images of different sizes in
one sequence of N patches, no padding to a common size). Output: [M, d_model], one row per
merged token, images in packing order.

Variant fields (VisionConfig): norm "rmsnorm" / "layernorm", bias on every projection,
projector_norm "post" (RMSNorm after, V2) / "pre" (LayerNorm before, K2.5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3_jax.config import ModelConfig, VisionConfig, jnp_dtype
from k3_jax.layers.init import Init
from k3_jax.layers.linear import Linear
from k3_jax.ops import vision as ops
from k3_jax.ops.norms import rms_norm

IMAGE_KEYS = ("patches", "pos_hw", "interp_idx", "interp_w", "segment_ids", "merge_idx")


class Bias(nnx.Module):
  def __init__(self, shape, axes, param_dtype):
    self.b = nnx.Param(jnp.zeros(tuple(shape), param_dtype), logical_axes=tuple(axes))

  def __call__(self, y):
    return y + self.b[...].astype(y.dtype)


class Dense(nnx.Module):
  """Linear (no bias) plus an optional bias (the K2.5 variant)."""

  def __init__(self, in_shape, out_shape, axes, bias: bool, *, init: Init, dtype, param_dtype,
               batch_axes=(), std=None):
    self.linear = Linear(in_shape, out_shape, axes, init=init, dtype=dtype,
                         param_dtype=param_dtype, batch_axes=batch_axes, std=std)
    n_out = 1 if isinstance(out_shape, int) else len(out_shape)
    out_shape = (out_shape,) if isinstance(out_shape, int) else tuple(out_shape)
    self.bias = Bias(out_shape, axes[-n_out:], param_dtype) if bias else nnx.data(None)

  def __call__(self, x):
    y = self.linear(x)
    return y if self.bias is None else self.bias(y)


class Norm(nnx.Module):
  """RMSNorm (V2) or LayerNorm with bias (K2.5) over the last axis."""

  def __init__(self, dim: int, kind: str, eps: float, param_dtype, axis_name: str = "norm"):
    self.kind, self.eps = kind, eps
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=(axis_name,))
    self.bias = (nnx.Param(jnp.zeros((dim,), param_dtype), logical_axes=(axis_name,))
                 if kind == "layernorm" else nnx.data(None))

  def __call__(self, x):
    if self.kind == "layernorm":
      return ops.layer_norm(x, self.weight[...], self.bias[...], self.eps)
    return rms_norm(x, self.weight[...], self.eps)


class VisionBlock(nnx.Module):
  """x + wo(attn(rope(wqkv(norm0 x)))), then x + fc1(gelu_tanh(fc0(norm1 x)))."""

  def __init__(self, v: VisionConfig, *, init: Init, dtype, param_dtype):
    self.v = v
    w, h, k = v.width, v.num_heads, v.head_dim
    self.norm0 = Norm(w, v.norm, v.norm_eps, param_dtype)
    self.norm1 = Norm(w, v.norm, v.norm_eps, param_dtype)
    # fused q, k, v: [width, 3, H, K]; Per-Head Muon orthogonalizes each (q/k/v, head) matrix
    self.wqkv = Dense(w, (3, h, k), ("embed", "qkv", "heads", "head_dim"), v.bias, init=init,
                      dtype=dtype, param_dtype=param_dtype, batch_axes=("qkv", "heads"))
    self.wo = Dense((h, k), w, ("heads", "head_dim", "embed"), v.bias, init=init, dtype=dtype,
                    param_dtype=param_dtype)
    self.fc0 = Dense(w, v.mlp_dim, ("embed", "mlp"), v.bias, init=init, dtype=dtype,
                     param_dtype=param_dtype)
    self.fc1 = Dense(v.mlp_dim, w, ("mlp", "embed"), v.bias, init=init, dtype=dtype,
                     param_dtype=param_dtype)

  def __call__(self, x, angles, segment_ids):
    """x [N, W], angles [N, K/2], segment_ids [N] -> [N, W]."""
    qkv = self.wqkv(self.norm0(x))                                   # [N, 3, H, K]
    q = ops.apply_rope_2d(qkv[:, 0], angles)
    k = ops.apply_rope_2d(qkv[:, 1], angles)
    o = ops.segment_attention(q, k, qkv[:, 2], segment_ids, self.v.head_dim ** -0.5)
    x = x + self.wo(o)                                               # [N, W]
    return x + self.fc1(ops.gelu_tanh(self.fc0(self.norm1(x))))


class VisionTower(nnx.Module):
  """Packed patches -> merged features [M, merge^2 * width] (before the projector)."""

  def __init__(self, v: VisionConfig, *, init: Init, dtype, param_dtype):
    self.v = v
    pixels = 3 * v.patch_size * v.patch_size
    self.patch_embed = Dense(pixels, v.width, ("patch", "embed"), v.bias, init=init,
                             dtype=dtype, param_dtype=param_dtype)
    self.pos_emb = nnx.Param(init.normal((v.pos_grid, v.pos_grid, v.width), 0.02, param_dtype),
                             logical_axes=("pos_grid", "pos_grid", "embed"))
    self.blocks = nnx.List([VisionBlock(v, init=init, dtype=dtype, param_dtype=param_dtype)
                            for _ in range(v.num_layers)])
    self.final_norm = Norm(v.width, v.norm, v.norm_eps, param_dtype)

  def encode(self, images: dict) -> jax.Array:
    """-> per-patch features after the final norm [N, W]."""
    x = self.patch_embed(images["patches"])                          # [N, W]
    pos = ops.interpolate_positions(self.pos_emb[...], images["interp_idx"], images["interp_w"])
    x = x + pos.astype(x.dtype)
    angles = ops.rope_2d_angles(images["pos_hw"], self.v.head_dim, self.v.rope_theta)
    for block in self.blocks:
      x = block(x, angles, images["segment_ids"])
    return self.final_norm(x)

  def __call__(self, images: dict) -> jax.Array:
    return ops.merge_patches(self.encode(images), images["merge_idx"])   # [M, 4W]


class Projector(nnx.Module):
  """[M, 4W] -> [M, d_model]. V2: Linear, GELU, Linear, RMSNorm. K2.5: LayerNorm (per patch,
  over W), Linear, GELU, Linear."""

  def __init__(self, v: VisionConfig, d_model: int, norm_eps: float, *, init: Init, dtype,
               param_dtype):
    self.v = v
    m = v.merged_dim
    self.pre_norm = (Norm(v.width, "layernorm", v.projector_eps, param_dtype)
                     if v.projector_norm == "pre" else nnx.data(None))
    self.linear_1 = Dense(m, m, ("merged", "mlp"), v.bias or v.projector_norm == "pre",
                          init=init, dtype=dtype, param_dtype=param_dtype)
    self.linear_2 = Dense(m, d_model, ("mlp", "embed"), v.bias or v.projector_norm == "pre",
                          init=init, dtype=dtype, param_dtype=param_dtype)
    self.post_norm = (Norm(d_model, "rmsnorm", norm_eps, param_dtype, axis_name="embed")
                      if v.projector_norm == "post" else nnx.data(None))

  def __call__(self, x):
    if self.pre_norm is not None:
      x = self.pre_norm(x.reshape(x.shape[0], -1, self.v.width)).reshape(x.shape)
    y = self.linear_2(ops.gelu(self.linear_1(x)))
    return y if self.post_norm is None else self.post_norm(y)


class VisionEncoder(nnx.Module):
  """Tower + projector: packed images -> LM-width features [M, d_model]."""

  def __init__(self, cfg: ModelConfig, *, init: Init):
    dt, pdt = jnp_dtype(cfg.dtype), jnp_dtype(cfg.param_dtype)
    self.tower = VisionTower(cfg.vision, init=init, dtype=dt, param_dtype=pdt)
    self.projector = Projector(cfg.vision, cfg.d_model, cfg.norm_eps, init=init, dtype=dt,
                               param_dtype=pdt)

  def __call__(self, images: dict) -> jax.Array:
    return self.projector(self.tower(images))


__all__ = ["VisionEncoder", "VisionTower", "Projector", "VisionBlock", "IMAGE_KEYS"]
