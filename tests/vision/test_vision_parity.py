"""MoonViT parity with Hugging Face transformers' Kimi_K25VisionModel +
Kimi_K25MultimodalProjection (PyTorch CPU, random weights, converted through the name map of
k3_jax/vision/names.py), on two images of different sizes packed into one sequence."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.kimi_k25.configuration_kimi_k25 import (Kimi_K25Config,
                                                                 Kimi_K25VisionConfig)
from transformers.models.kimi_k25.modeling_kimi_k25 import (Kimi_K25MultimodalProjection,
                                                            Kimi_K25VisionModel)

from configs import vision as vision_presets
from k3_jax.config import ModelConfig
from k3_jax.data import images as im
from k3_jax.layers.init import Init
from k3_jax.vision.names import export_vision, import_vision, vision_names
from k3_jax.vision.tower import VisionEncoder

D_MODEL = 48
# The K2.5 variant (LayerNorm with biases, biased q/k/v, pre-norm projector), shrunk. An 8 x 8
# position table, so the two grids below resample it both down (10 -> 8 wide... and 6 -> 8)
# and up.
V = dataclasses.replace(vision_presets.kimi_k25(), num_layers=2, width=64, num_heads=4,
                        head_dim=16, mlp_dim=96, pos_grid=8)
GRIDS = ((6, 10), (4, 4))     # (h, w) patches: 84 x 140 and 56 x 56 pixels


def _hf_modules():
  torch.manual_seed(0)
  vcfg = Kimi_K25VisionConfig(patch_size=V.patch_size, pos_emb_height=V.pos_grid,
                              pos_emb_width=V.pos_grid, num_attention_heads=V.num_heads,
                              num_hidden_layers=V.num_layers, hidden_size=V.width,
                              intermediate_size=V.mlp_dim,
                              rope_parameters={"rope_type": "axial", "rope_theta": V.rope_theta})
  vcfg._attn_implementation = "eager"
  cfg = Kimi_K25Config(vision_config=vcfg.to_dict(),
                       text_config={"model_type": "deepseek_v3", "hidden_size": D_MODEL},
                       projection_hidden_size=V.width)
  tower, proj = Kimi_K25VisionModel(vcfg).eval(), Kimi_K25MultimodalProjection(cfg).eval()
  # random values everywhere (biases and norm gains included), so every tensor matters
  with torch.no_grad():
    for mod in (tower, proj):
      for name, p in mod.named_parameters():
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or \
           name.endswith("layernorm.weight") or name.endswith("pre_norm.weight"):
          p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif "position_embeddings" in name:
          p.copy_(torch.randn_like(p))
        else:
          p.copy_(0.2 * torch.randn_like(p) / max(1, p.shape[-1]) ** 0.5 * 3)
  return tower, proj


@pytest.fixture(scope="module")
def setup():
  tower, proj = _hf_modules()
  tensors = {f"vision_tower.{k}": v.numpy() for k, v in tower.state_dict().items()}
  tensors.update({f"mm_projector.{k}": v.numpy() for k, v in proj.state_dict().items()})
  cfg = ModelConfig(d_model=D_MODEL, vision=V)
  enc = VisionEncoder(cfg, init=Init(0))
  import_vision(enc, tensors, V, D_MODEL, layout="kimi_k25")
  graphdef, state = nnx.split(enc)
  run = jax.jit(lambda s, images: nnx.merge(graphdef, s)(images))
  rng = np.random.default_rng(0)
  imgs = [im.to_patches(rng.integers(0, 256, (h * 14, w * 14, 3), dtype=np.uint8), V,
                        resize=False) for h, w in GRIDS]
  return dict(tower=tower, proj=proj, tensors=tensors, state=state, run=run, imgs=imgs)


def _hf_features(tower, proj, imgs):
  pixels = torch.from_numpy(np.concatenate([p for p, _ in imgs])).reshape(-1, 3, 14, 14)
  grid = torch.tensor([[1, h, w] for _, (h, w) in imgs])
  with torch.no_grad():
    pooled = tower(pixels, grid_thw=grid).pooler_output                 # [M, 4, W]
    return proj(pooled).squeeze(1).numpy()                              # [M, D]


def test_packed_features_match_transformers(setup):
  ref = _hf_features(setup["tower"], setup["proj"], setup["imgs"])
  packed = im.pack_images(setup["imgs"], V)
  ours = np.asarray(setup["run"](setup["state"], packed))
  assert ours.shape == ref.shape == (sum(h * w for h, w in GRIDS) // 4, D_MODEL)
  # FP32 on both sides with the same math; what differs is summation order (matmuls,
  # bicubic taps, softmax): ~1e-6 relative per op, a few e-6 after two layers and the
  # projector. 1e-4 of the features' scale leaves room for that and nothing else: a wrong
  # RoPE pairing, tap or norm moves features by O(1) of their scale.
  scale = np.abs(ref).max()
  np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * scale)


def test_packing_two_images_equals_each_alone(setup):
  run, state, imgs = setup["run"], setup["state"], setup["imgs"]
  together = np.asarray(run(state, im.pack_images(imgs, V)))
  alone = np.concatenate([np.asarray(run(state, im.pack_images([x], V))) for x in imgs])
  # Block-diagonal attention: the other image contributes exactly zero weight (exp(-1e30)
  # underflows to 0), so only the matmul summation order over a longer key axis differs.
  np.testing.assert_allclose(together, alone, rtol=0, atol=1e-5 * np.abs(alone).max())


def test_padding_patches_do_not_change_features(setup):
  run, state, imgs = setup["run"], setup["state"], setup["imgs"]
  plain = np.asarray(run(state, im.pack_images(imgs, V)))
  padded = np.asarray(run(state, im.pack_images(imgs, V, pad_to=96)))
  np.testing.assert_allclose(padded, plain, rtol=0, atol=1e-5 * np.abs(plain).max())


def test_name_map_round_trips_transformers_tensors(setup):
  out = export_vision(setup["state"], V, D_MODEL, layout="kimi_k25")
  assert sorted(out) == sorted(setup["tensors"]) == sorted(vision_names(V, D_MODEL, "kimi_k25"))
  for name, value in setup["tensors"].items():
    np.testing.assert_array_equal(out[name], value, err_msg=name)
