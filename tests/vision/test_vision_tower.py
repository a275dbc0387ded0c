"""MoonViT-V2 structure, 2-D RoPE, placeholders and image handling (no torch needed)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

import configs
from configs import vision as vision_presets
from k3_jax.config import ConfigError
from k3_jax.data import images as im
from k3_jax.model import abstract_model, create_model, param_counts
from k3_jax.ops.vision import apply_rope_2d, rope_2d_angles, scatter_features
from k3_jax.vision.names import vision_entries, vision_names


# ----- 2-D RoPE -----------------------------------------------------------------------

def test_rope_2d_equals_complex_rotation():
  head_dim, theta = 16, 10000.0
  rng = np.random.default_rng(0)
  pos = np.stack(np.meshgrid(np.arange(5), np.arange(7), indexing="ij"), -1).reshape(-1, 2)
  x = rng.standard_normal((pos.shape[0], 3, head_dim)).astype(np.float32)   # [N, H, K]
  ours = np.asarray(apply_rope_2d(jnp.asarray(x), rope_2d_angles(jnp.asarray(pos), head_dim,
                                                                  theta)))
  # Reference written from the spec sentence: complex pairs (x[2p], x[2p+1]); pair 2i turns by
  # column * f_i, pair 2i+1 by row * f_i, f_i = theta^(-4i/head_dim).
  ref = np.empty_like(x)
  for n, (row, col) in enumerate(pos):
    for p in range(head_dim // 2):
      f = theta ** (-4.0 * (p // 2) / head_dim)
      angle = (col if p % 2 == 0 else row) * f
      z = (x[n, :, 2 * p] + 1j * x[n, :, 2 * p + 1]) * np.exp(1j * angle)
      ref[n, :, 2 * p], ref[n, :, 2 * p + 1] = z.real, z.imag
  # f32 cos/sin of angles up to 6 rad: ~1e-6 absolute on unit-scale inputs
  np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)


# ----- the released V2 tower ---------------------------------------------------------------

def test_k3_tower_shapes_and_parameter_count():
  cfg = configs.get_multimodal("k3")
  v = cfg.vision
  assert (v.num_layers, v.width, v.num_heads, v.head_dim, v.mlp_dim) == (27, 1024, 12, 128, 4096)
  vis = abstract_model(cfg).vision                       # ShapeDtypeStructs: nothing allocated
  blk = vis.tower.blocks[0]
  assert blk.wqkv.linear.w.shape == (1024, 3, 12, 128)     # 1024 -> 3 x 1536
  assert blk.wo.linear.w.shape == (12, 128, 1024)          # 1536 -> 1024
  assert blk.fc0.linear.w.shape == (1024, 4096) and blk.fc1.linear.w.shape == (4096, 1024)
  assert blk.wqkv.bias is None and blk.norm0.bias is None  # no biases, RMSNorm
  assert vis.tower.pos_emb.shape == (64, 64, 1024)
  assert vis.tower.patch_embed.linear.w.shape == (3 * 14 * 14, 1024)
  assert vis.projector.linear_1.linear.w.shape == (4096, 4096)
  assert vis.projector.linear_2.linear.w.shape == (4096, 7168)
  per_layer = 1024 * 3 * 1536 + 1536 * 1024 + 2 * 1024 * 4096 + 2 * 1024
  tower = 27 * per_layer + 588 * 1024 + 64 * 64 * 1024 + 1024
  projector = 4096 * 4096 + 4096 * 7168 + 7168
  counts = param_counts(cfg)
  assert counts["by_module"]["vision.tower"] == tower == 401_214_464   # "about 0.4B"
  assert counts["vision_params"] == tower + projector
  # the language model's figures are unchanged by the tower (the text-only k3's count)
  assert counts["total_params"] == 2_779_483_053_152
  # every parameter has exactly one released name, and the shapes agree
  flat = dict(nnx.to_flat_state(nnx.state(vis, nnx.Param)))
  entries = vision_entries(v, cfg.d_model, "k3")
  assert {e.path for e in entries} == set(flat)
  names = vision_names(v, cfg.d_model, "k3")
  assert len(names) == len(set(names)) == len(flat)
  assert "vision_tower.encoder.blocks.26.wqkv.weight" in names
  assert "mm_projector.post_norm.weight" in names


def test_optimizer_groups_and_sharding_cover_the_tower():
  from k3_jax.optim.muon import ADAMW, MUON, PER_HEAD, param_group
  from sharding.mesh import make_mesh, parse_mesh
  from sharding.rules import tree_shardings
  cfg = configs.get_multimodal("k3_tiny")
  state = nnx.state(abstract_model(cfg), nnx.Param)["vision"]
  groups = {".".join(map(str, p)): param_group(v).group
            for p, v in nnx.to_flat_state(state)}
  assert groups["tower.blocks.0.wqkv.linear.w"] == PER_HEAD   # per (q/k/v, head)
  for name in ("tower.blocks.0.wo.linear.w", "tower.blocks.1.fc0.linear.w",
               "tower.patch_embed.linear.w", "projector.linear_2.linear.w"):
    assert groups[name] == MUON, name
  for name in ("tower.pos_emb", "tower.blocks.0.norm0.weight", "projector.post_norm.weight"):
    assert groups[name] == ADAMW, name
  # every vision parameter has a sharding rule; on a 2-way fsdp mesh the width is split
  mesh = make_mesh(parse_mesh("fsdp:2"), devices=jax.devices()[:2])
  sh = tree_shardings(state, mesh)
  spec = sh["tower"]["blocks"][0]["fc0"]["linear"]["w"].spec
  assert tuple(spec) == ("fsdp", None)


def test_text_only_presets_have_no_tower():
  for name in ("k3", "k3_small", "k3_tiny"):
    assert configs.get(name).vision is None
  with pytest.raises(ConfigError, match="no vision tower"):
    configs.get_multimodal("kimi_linear_48b")


# ----- placeholders ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
  cfg = configs.get_multimodal("k3_tiny")
  model = create_model(cfg)
  graphdef, state = nnx.split(model)
  embed = jax.jit(lambda s, t, images: nnx.merge(graphdef, s).embed_inputs(t, images))
  features = jax.jit(lambda s, images: nnx.merge(graphdef, s).vision(images))
  return cfg, state, embed, features


def _image(h, w, seed):
  return np.random.default_rng(seed).integers(0, 256, (h * 14, w * 14, 3), dtype=np.uint8)


def test_features_land_exactly_at_placeholders(tiny):
  cfg, state, embed, features = tiny
  v = cfg.vision
  enc = lambda s: list(s.encode())
  imgs = [im.to_patches(_image(2, 4, 1), v, resize=False),
          im.to_patches(_image(4, 2, 2), v, resize=False)]
  ids = enc("look: ") + im.image_token_ids(imgs[0][1], v, enc) + enc(" and ") + \
      im.image_token_ids(imgs[1][1], v, enc) + enc("!")
  packed = im.pack_images(imgs, v)
  im.check_placeholders(ids, packed["merge_idx"].shape[0], v)
  tokens = jnp.asarray([ids])
  x = np.asarray(embed(state, tokens, packed))[0]                        # [T, D]
  plain = np.asarray(embed(state, tokens, None))[0]
  feats = np.asarray(features(state, packed))                             # [4, D]
  where = np.flatnonzero(np.asarray(ids) == v.image_token_id)
  assert len(where) == feats.shape[0] == 4
  np.testing.assert_array_equal(x[where], feats)                        # in order, exactly
  others = np.setdiff1d(np.arange(len(ids)), where)
  np.testing.assert_array_equal(x[others], plain[others])               # text untouched
  assert not np.allclose(x[where], plain[where])


def test_scatter_over_batch_rows_is_row_major():
  x = jnp.zeros((2, 3, 1))
  tokens = jnp.asarray([[9, 1, 9], [1, 9, 1]])
  out = scatter_features(x, tokens, jnp.asarray([[1.0], [2.0], [3.0]]), placeholder_id=9)
  np.testing.assert_array_equal(np.asarray(out)[..., 0], [[1, 0, 2], [0, 3, 0]])


def test_placeholder_count_mismatch_is_a_clear_error():
  v = vision_presets.tiny()
  with pytest.raises(ValueError, match=r"holds 3 image placeholder tokens .* give 4 features"):
    im.check_placeholders([1, v.image_token_id, v.image_token_id, v.image_token_id, 2], 4, v)


def test_text_model_refuses_images():
  cfg = configs.get("k3_tiny")
  model = abstract_model(cfg)
  with pytest.raises(ConfigError, match="no vision tower"):
    model.embed_inputs(jnp.zeros((1, 4), jnp.int32), {"patches": None})


# ----- preprocessing and bad images ----------------------------------------------------------

def test_fit_grid_respects_multiples_side_limit_and_budget():
  v = dataclasses.replace(vision_presets.k3(), max_patches=4096, max_side=64)
  for w, h in ((1000, 700), (100_000, 300), (30, 30), (5, 9000), (28 * 64, 28 * 64)):
    gh, gw = im.fit_grid(w, h, v)
    assert gh % 2 == 0 and gw % 2 == 0 and gh >= 2 and gw >= 2
    assert max(gh, gw) <= 64 and gh * gw <= 4096, (w, h, gh, gw)
  assert im.fit_grid(280, 140, v) == (10, 20)          # small enough: kept (pixels / 14)


def test_to_patches_layout_and_normalisation():
  v = vision_presets.tiny()
  img = _image(2, 2, 3)
  patches, grid = im.to_patches(img, v, resize=False)
  assert grid == (2, 2) and patches.shape == (4, 588)
  # patch (row 1, col 0), channel 2, pixel (3, 5) of the patch
  expect = (img[14 + 3, 5, 2] / 255.0 - 0.5) / 0.5
  assert patches[2].reshape(3, 14, 14)[2, 3, 5] == pytest.approx(expect, abs=1e-6)


def test_bad_images_give_clear_errors(tmp_path):
  v = vision_presets.tiny()
  with pytest.raises(im.ImageError, match="file not found"):
    im.load_image(tmp_path / "missing.png")
  junk = tmp_path / "junk.png"
  junk.write_bytes(b"this is not a png")
  with pytest.raises(im.ImageError, match="junk.png.*not a readable image"):
    im.load_image(junk)
  with pytest.raises(im.ImageError, match="zero size"):
    im.to_patches(np.zeros((0, 28, 3), np.uint8), v)
  with pytest.raises(im.ImageError, match="zero size"):
    im.fit_grid(0, 10, v)
  big = dataclasses.replace(v, max_patches=16)
  with pytest.raises(im.ImageError, match="exceeds the patch budget"):
    im.to_patches(_image(6, 4, 0), big, resize=False)                    # 24 > 16 patches
  p = im.to_patches(_image(4, 4, 0), v, resize=False)
  with pytest.raises(im.ImageError, match="beyond the patch budget of 20"):
    im.pack_images([p, p], v, max_total_patches=20)
  ok = tmp_path / "ok.png"
  Image.fromarray(_image(3, 5, 0)).save(ok)
  ids, packed = im.prompt_with_images("a ", [str(ok)], " b", v, lambda s: list(s.encode()))
  assert packed["merge_idx"].shape[0] == ids.count(v.image_token_id) > 0
