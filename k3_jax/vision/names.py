"""Released tensor names of the vision tower and projector, with the transforms to and from
this project's arrays: the piece a checkpoint converter plugs in (docs/architecture.md sections 8, 11).

Two layouts:
  "k3"        the K3 release: `vision_tower.patch_embed.proj`, `vision_tower.patch_embed.pos_emb`,
              `vision_tower.encoder.blocks.{i}.{norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}`,
              `vision_tower.encoder.final_layernorm`, `mm_projector.{linear_1,linear_2,post_norm}`
              (with `.bias` tensors too when VisionConfig.bias; K3 itself has none). The fused
              wqkv keeps our head-dim order (complex pairs adjacent), as the spec describes.
  "kimi_k25"  transformers' Kimi_K25VisionModel / Kimi_K25MultimodalProjection (5.23):
              `vision_tower.layers.{i}.{norm1,norm2,attn.q_proj,attn.k_proj,attn.v_proj,
              attn.proj,mlp.fc1,mlp.fc2}`, `vision_tower.patch_embed.pos_emb.position_embeddings`,
              `vision_tower.final_layernorm`, `mm_projector.{pre_norm,in_proj,out_proj}`
              (under `model.` in Kimi_K25ForConditionalGeneration). Its RoPE rotates
              (j, j + K/2) pairs (rotate_half) where we rotate (2j, 2j + 1): q and k rows are
              permuted per head on the way in and back on the way out; the dot products, and
              so the outputs, are unchanged.

Every entry: (our path under the model's `vision` module, released names, to_ours(list of
arrays) -> array, from_ours(array) -> list of arrays). Linear weights are stored [out, in]
(PyTorch order); ours are [in..., out...].
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from k3_jax.config import VisionConfig

LAYOUTS = ("k3", "kimi_k25")


class Entry(NamedTuple):
  path: tuple                          # e.g. ("tower", "blocks", 0, "wqkv", "linear", "w")
  names: tuple[str, ...]               # released tensor names (one or more)
  to_ours: Callable[[list], np.ndarray]
  from_ours: Callable[[np.ndarray], list]


def _same(path, name):
  return Entry(path, (name,), lambda a: np.asarray(a[0]), lambda x: [np.asarray(x)])


def _linear(path, name, in_shape, out_shape, released_shape=None):
  """Released [out, in] (or `released_shape`, e.g. the patch conv's [out, 3, p, p]) <-> ours
  [*in_shape, *out_shape]."""
  n_in, n_out = int(np.prod(in_shape)), int(np.prod(out_shape))
  released_shape = released_shape or (n_out, n_in)
  return Entry(path, (name,),
               lambda a: np.asarray(a[0]).reshape(n_out, n_in).T.reshape(*in_shape, *out_shape),
               lambda x: [np.asarray(x).reshape(n_in, n_out).T.reshape(released_shape)])


def _bias(path, name, shape):
  return Entry(path, (name,), lambda a: np.asarray(a[0]).reshape(shape),
               lambda x: [np.asarray(x).reshape(-1)])


def _halves_to_pairs(w: np.ndarray, heads: int, k: int) -> np.ndarray:
  """[H*K, ...] rows in rotate_half order per head -> adjacent-pair order."""
  rest = w.shape[1:]
  return w.reshape(heads, 2, k // 2, *rest).swapaxes(1, 2).reshape(heads * k, *rest)


def _pairs_to_halves(w: np.ndarray, heads: int, k: int) -> np.ndarray:
  rest = w.shape[1:]
  return w.reshape(heads, k // 2, 2, *rest).swapaxes(1, 2).reshape(heads * k, *rest)


def _hf_qkv(path, prefix, v: VisionConfig, kind: str):
  """transformers' q_proj, k_proj, v_proj (weights [H*K, W] or biases [H*K]) <-> our fused
  wqkv [W, 3, H, K] (bias [3, H, K])."""
  h, k, w = v.num_heads, v.head_dim, v.width
  names = tuple(f"{prefix}.{p}_proj.{kind}" for p in "qkv")

  def to_ours(arrs):
    arrs = [np.asarray(a) for a in arrs]
    arrs = [_halves_to_pairs(arrs[0], h, k), _halves_to_pairs(arrs[1], h, k), arrs[2]]
    stacked = np.stack(arrs)                                          # [3, H*K(, W)]
    if kind == "bias":
      return stacked.reshape(3, h, k)
    return stacked.reshape(3, h, k, w).transpose(3, 0, 1, 2)          # [W, 3, H, K]

  def from_ours(x):
    x = np.asarray(x)
    parts = x.reshape(3, h * k) if kind == "bias" else x.reshape(w, 3, h * k).transpose(1, 2, 0)
    return [_pairs_to_halves(parts[0], h, k), _pairs_to_halves(parts[1], h, k), parts[2]]

  return Entry(path, names, to_ours, from_ours)


def vision_entries(v: VisionConfig, d_model: int, layout: str = "k3") -> list[Entry]:
  """Every vision parameter's released name(s) and transforms, in a stable order."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout {layout!r}: must be one of {', '.join(LAYOUTS)}")
  w, h, k, m = v.width, v.num_heads, v.head_dim, v.merged_dim
  pix = (3 * v.patch_size * v.patch_size,)
  ln = v.norm == "layernorm"
  out: list[Entry] = []
  T = ("tower",)

  def norm(path, name):
    out.append(_same(path + ("weight",), f"{name}.weight"))
    if ln:
      out.append(_same(path + ("bias",), f"{name}.bias"))

  def dense(path, name, in_shape, out_shape, bias, released_shape=None):
    out.append(_linear(path + ("linear", "w"), f"{name}.weight", in_shape, out_shape,
                       released_shape))
    if bias:
      out.append(_bias(path + ("bias", "b"), f"{name}.bias", out_shape))

  dense(T + ("patch_embed",), "vision_tower.patch_embed.proj", pix, (w,), v.bias,
        (w, 3, v.patch_size, v.patch_size))      # a conv with stride = kernel = patch
  pos_name = ("vision_tower.patch_embed.pos_emb.weight" if layout == "k3"
              else "vision_tower.patch_embed.pos_emb.position_embeddings")
  out.append(_same(T + ("pos_emb",), pos_name))
  for i in range(v.num_layers):
    b = T + ("blocks", i)
    if layout == "k3":
      pre = f"vision_tower.encoder.blocks.{i}"
      norm(b + ("norm0",), f"{pre}.norm0")
      norm(b + ("norm1",), f"{pre}.norm1")
      dense(b + ("wqkv",), f"{pre}.wqkv", (w,), (3, h, k), v.bias)
      dense(b + ("wo",), f"{pre}.wo", (h, k), (w,), v.bias)
      dense(b + ("fc0",), f"{pre}.mlp.fc0", (w,), (v.mlp_dim,), v.bias)
      dense(b + ("fc1",), f"{pre}.mlp.fc1", (v.mlp_dim,), (w,), v.bias)
    else:
      pre = f"vision_tower.layers.{i}"
      norm(b + ("norm0",), f"{pre}.norm1")
      norm(b + ("norm1",), f"{pre}.norm2")
      out.append(_hf_qkv(b + ("wqkv", "linear", "w"), f"{pre}.attn", v, "weight"))
      if v.bias:
        out.append(_hf_qkv(b + ("wqkv", "bias", "b"), f"{pre}.attn", v, "bias"))
      dense(b + ("wo",), f"{pre}.attn.proj", (h, k), (w,), v.bias)
      dense(b + ("fc0",), f"{pre}.mlp.fc1", (w,), (v.mlp_dim,), v.bias)
      dense(b + ("fc1",), f"{pre}.mlp.fc2", (v.mlp_dim,), (w,), v.bias)
  norm(T + ("final_norm",),
       "vision_tower.encoder.final_layernorm" if layout == "k3" else "vision_tower.final_layernorm")
  P = ("projector",)
  pbias = v.bias or v.projector_norm == "pre"
  if v.projector_norm == "pre":
    out.append(_same(P + ("pre_norm", "weight"), "mm_projector.pre_norm.weight"))
    out.append(_same(P + ("pre_norm", "bias"), "mm_projector.pre_norm.bias"))
  l1, l2 = (("linear_1", "linear_2") if layout == "k3" else ("in_proj", "out_proj"))
  dense(P + ("linear_1",), f"mm_projector.{l1}", (m,), (m,), pbias)
  dense(P + ("linear_2",), f"mm_projector.{l2}", (m,), (d_model,), pbias)
  if v.projector_norm == "post":
    out.append(_same(P + ("post_norm", "weight"), "mm_projector.post_norm.weight"))
  return out


def vision_names(v: VisionConfig, d_model: int, layout: str = "k3") -> list[str]:
  """Every released vision tensor name of `layout`."""
  return [n for e in vision_entries(v, d_model, layout) for n in e.names]


def import_vision(state, tensors: dict, v: VisionConfig, d_model: int, layout: str = "k3",
                  prefix: str = "") -> None:
  """Writes released tensors (name -> array; names as `vision_names`, after `prefix`) into
  `state`, the nnx state (or module) of the model's `vision` encoder, in place. Missing
  names and shape mismatches are errors naming the tensor."""
  from flax import nnx
  flat = dict(nnx.to_flat_state(nnx.state(state) if isinstance(state, nnx.Module) else state))
  entries = vision_entries(v, d_model, layout)
  if len(entries) != len(flat):
    extra = sorted(set(flat) - {e.path for e in entries})
    raise ValueError(f"vision name map covers {len(entries)} tensors, the model has "
                     f"{len(flat)}; unmapped: {extra[:5]}")
  for e in entries:
    missing = [prefix + n for n in e.names if prefix + n not in tensors]
    if missing:
      raise KeyError(f"vision tensors missing from the checkpoint: {missing}")
    value = e.to_ours([np.asarray(tensors[prefix + n], np.float32) for n in e.names])
    var = flat[e.path]
    if tuple(value.shape) != tuple(var.shape):
      raise ValueError(f"{e.names}: shape {value.shape} does not match the model's "
                       f"{tuple(var.shape)} at {'.'.join(map(str, e.path))}")
    var[...] = value.astype(var[...].dtype)


def export_vision(state, v: VisionConfig, d_model: int, layout: str = "k3",
                  prefix: str = "") -> dict[str, np.ndarray]:
  """The released tensors (name -> numpy array) of the `vision` encoder's state."""
  from flax import nnx
  flat = dict(nnx.to_flat_state(nnx.state(state) if isinstance(state, nnx.Module) else state))
  out = {}
  for e in vision_entries(v, d_model, layout):
    for n, a in zip(e.names, e.from_ours(np.asarray(flat[e.path][...]))):
      out[prefix + n] = a
  return out


__all__ = ["LAYOUTS", "Entry", "vision_entries", "vision_names", "import_vision",
           "export_vision"]
