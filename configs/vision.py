"""Vision towers (docs/architecture.md section 8), one function each; model presets attach
theirs with `get_vision_config()`, and `configs.get_multimodal(name)` returns the preset with
its tower.

Byte-level presets (vocab 256) reserve the four media tokens in bytes that never occur in
UTF-8 text (0xFC-0xFF), so the text vocabulary and every text checkpoint stay unchanged.

A job that uses images attaches its preset's tower (docs/vision.md):

    python main.py train --config=k3_small --dataset=shapes --steps=240 --batch_size=16 \\
        --seq_len=72 --eval_every=80 --checkpoint_every=80 --workdir=runs/shapes
    python main.py generate --workdir=runs/shapes --image=picture.png --max_new_tokens=48
"""

from k3_jax.config import VisionConfig

# <|media_begin|>, <|media_content|>, <|media_end|>, image placeholder for byte vocabularies
BYTE_MEDIA_IDS = dict(media_begin_id=252, media_content_id=253, media_end_id=254,
                      image_token_id=255)


def k3() -> VisionConfig:
  """The released K3 tower, MoonViT-V2: 27 layers, width 1024, 12 x 128 heads, MLP 4096,
  RMSNorm, no biases, post-norm projector (about 0.4B parameters)."""
  return VisionConfig()


def kimi_k25() -> VisionConfig:
  """The earlier MoonViT of Kimi K2.5 (transformers' Kimi_K25VisionModel defaults): width
  1152, 16 heads of 72, MLP 4304, LayerNorm with biases, biased projections, pre-norm
  projector. Parity tests shrink it with dataclasses.replace."""
  return VisionConfig(num_layers=27, width=1152, num_heads=16, head_dim=72, mlp_dim=4304,
                      norm="layernorm", bias=True, projector_norm="pre", projector_eps=1e-5)


def small() -> VisionConfig:
  """k3_small's tower: 4 layers, width 128, 4 x 48 heads (attention wider than the model, as
  in V2), 32 x 32 position table."""
  return VisionConfig(num_layers=4, width=128, num_heads=4, head_dim=48, mlp_dim=512,
                      pos_grid=32, max_patches=4096, max_side=128, **BYTE_MEDIA_IDS)


def tiny() -> VisionConfig:
  """k3_tiny's tower, for tests: 2 layers, width 32, 2 x 24 heads, 8 x 8 position table."""
  return VisionConfig(num_layers=2, width=32, num_heads=2, head_dim=24, mlp_dim=64,
                      pos_grid=8, max_patches=1024, max_side=64, **BYTE_MEDIA_IDS)
