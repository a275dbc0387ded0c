"""Multimodal training: the shapes dataset, a train step on packed images + text, and a text
model left exactly as it was by the tower's presence."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import vision as vision_presets
from k3_jax import train
from k3_jax.config import (KDAConfig, MLAConfig, ModelConfig, MoEConfig, TrainConfig,
                           validate)
from k3_jax.data import shapes, tokenizers
from k3_jax.model import create_model
from sharding.mesh import make_mesh

# Two layers (dense+KDA, MoE+MLA) and the tiny tower: a short compile.
TEXT = validate(ModelConfig(
    name="mm_micro", vocab_size=256, d_model=32, num_layers=2, mla_layers=(2,),
    dense_layers=(1,), dense_intermediate=64, eos_id=0,
    kda=KDAConfig(num_heads=2, head_dim=8),
    mla=MLAConfig(num_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=8),
    moe=MoEConfig(num_experts=4, top_k=2, expert_intermediate=16)))
MM = validate(dataclasses.replace(TEXT, vision=vision_presets.tiny()))
# One MLA + dense layer: the cheapest backward pass through a K3 decoder layer.
MM1 = validate(dataclasses.replace(MM, name="mm_one", num_layers=1, mla_layers=(1,)))
TOK = tokenizers.get_tokenizer("byte")
SEQ = 72


def test_tower_leaves_the_text_model_unchanged():
  text = create_model(dataclasses.replace(MM1, vision=None), seed=3)
  mm = create_model(MM1, seed=3)
  t_state = dict(nnx.to_flat_state(nnx.state(text)))
  m_state = dict(nnx.to_flat_state(nnx.state(mm)))
  assert set(m_state) - set(t_state) and all(p[0] == "vision" for p in set(m_state) - set(t_state))
  for path, var in t_state.items():        # same initial values: the tower is drawn last
    np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(m_state[path][...]))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 250, (2, 24)))
  fwd = nnx.jit(lambda m, t: m(t)[0])
  np.testing.assert_array_equal(np.asarray(fwd(text, tokens)), np.asarray(fwd(mm, tokens)))


def test_shapes_labels_match_the_pixels():
  for i in range(12):
    img, label = shapes.draw(np.random.default_rng([5, i]))
    bg = np.median(img.reshape(-1, 3), axis=0)
    mask = np.abs(img.astype(int) - bg).sum(-1) > 60                 # the shape's pixels
    ys, xs = np.nonzero(mask)
    top, left = ys.mean() < shapes.IMAGE_PX / 2, xs.mean() < shapes.IMAGE_PX / 2
    want = shapes.POSITIONS.index(label["position"])
    assert (int(not top) * 2 + int(not left)) == want, label
    np.testing.assert_allclose(img[mask].mean(0), shapes.COLORS[label["color"]], atol=30)
    assert label["caption"] == f"a {label['color']} {label['shape']} at the {label['position']}"


def test_shapes_iterator_resumes_exactly():
  it = shapes.ShapesIterator(2, SEQ, MM.vision, TOK, seed=1)
  next(it)
  saved = it.get_state()
  want = next(it)
  again = shapes.ShapesIterator(2, SEQ, MM.vision, TOK, seed=1)
  again.set_state(saved)
  got = next(again)
  for k in ("inputs", "targets", "loss_mask"):
    np.testing.assert_array_equal(got[k], want[k])
  np.testing.assert_array_equal(got["images"]["patches"], want["images"]["patches"])
  with pytest.raises(ValueError, match="different pipeline"):
    shapes.ShapesIterator(2, SEQ, MM.vision, TOK, seed=2).set_state(saved)
  with pytest.raises(ValueError, match="too short for the shapes dataset"):
    shapes.make_batch(0, 0, 1, 40, MM.vision, TOK)


def test_loss_gradient_reaches_the_tower_and_images_matter():
  graphdef, params, rest = train.split_model(create_model(MM1, seed=0))
  batch, _ = shapes.make_batch(7, 0, 2, SEQ, MM1.vision, TOK)
  other, _ = shapes.make_batch(8, 0, 2, SEQ, MM1.vision, TOK)

  @jax.jit
  def f(params, batch):
    def loss(p):
      s, n, _ = train.loss_terms(graphdef, p, rest, batch)
      return s / n
    return jax.value_and_grad(loss)(params)

  l1, g = f(params, batch)
  norms = jax.tree.leaves(jax.tree.map(lambda a: float(jnp.abs(a).max()), g["vision"]))
  assert norms and min(norms) > 0          # every tower and projector tensor gets a gradient
  l2, _ = f(params, dict(batch, images=other["images"]))   # same text, other images
  assert np.isfinite(float(l1)) and float(l1) != float(l2)


@pytest.mark.slow
def test_train_step_on_images_and_text():
  tc = TrainConfig(steps=4, batch_size=2, seq_len=SEQ, optimizer="muon", eval_every=1,
                   eval_batches=1)
  steps = train.build_steps(MM, tc, make_mesh(devices=jax.devices()[:1]))
  state = steps.init()
  before = jax.tree.map(np.asarray, state["params"]["vision"])
  batch, _ = shapes.make_batch(7, 0, 2, SEQ, MM.vision, TOK)
  put = train.put_batch(batch, steps.batch_sharding)
  state, metrics = steps.train(state, put)        # step 0 of the warmup: lr 0
  state, metrics = steps.train(state, train.put_batch(batch, steps.batch_sharding))
  assert np.isfinite(float(metrics["loss"]))
  # the caption tokens are the only targets
  assert float(metrics["tokens"]) == batch["loss_mask"].sum()
  # the loss reaches the tower: every vision parameter moved (Muon / AdamW steps)
  after = jax.tree.map(np.asarray, state["params"]["vision"])
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), before, after))
  assert moved and all(moved)
  # the images matter: the same text with other images gives another loss
  other, _ = shapes.make_batch(8, 0, 2, SEQ, MM.vision, TOK)
  swapped = dict(batch, images=other["images"])
  l1, n1 = steps.eval(state, put)
  l2, n2 = steps.eval(state, train.put_batch(swapped, steps.batch_sharding))
  assert float(n1) == float(n2) and float(l1) != float(l2)


@pytest.mark.slow   # ~6 s (suite budget); images in a served request against a full forward
# stay in the default suite (test_server.py::test_chat_with_image_matches_a_full_forward)
def test_generate_with_images_matches_a_full_forward(tmp_path):
  """`generate --image` (generate.prompt_ids + the batched engine) == argmax of one forward
  pass over the prompt + generated tokens with the same images."""
  from PIL import Image
  from k3_jax.config import UserError
  from k3_jax.config import SINGLE_STREAM
  from k3_jax.serve.engine import Engine
  from k3_jax.serve.generate import prompt_ids
  from k3_jax.serve.loader import Restored
  model = create_model(MM1, seed=1)
  graphdef, params, rest = train.split_model(model)
  restored = Restored(MM1, Engine(MM1, graphdef, params, rest, SINGLE_STREAM), TOK, 0)
  paths = []
  for i, (h, w) in enumerate(((2, 4), (4, 2))):
    img = np.random.default_rng(i).integers(0, 256, (h * 14, w * 14, 3), dtype=np.uint8)
    paths.append(str(tmp_path / f"{i}.png"))
    Image.fromarray(img).save(paths[-1])
  ids, packed = prompt_ids(restored, " is", paths)
  out = list(restored.engine.generate(ids, 3, images=packed))
  # greedy decoding after a prefill with images == argmax of one forward pass over the
  # prompt + generated tokens with the same images (the decode path sees no images)
  full = jnp.asarray([ids + out[:-1]])
  logits = nnx.jit(lambda m, t, images: m(t, images=images)[0])(model, full, packed)
  want = np.asarray(jnp.argmax(logits[0, len(ids) - 1:], -1)).tolist()
  assert out == want
  first = ids.index(MM1.vision.image_token_id)
  with pytest.raises(UserError, match="image placeholder tokens"):
    list(restored.engine.generate(ids[:first] + ids[first + 1:], 2, images=packed))
  with pytest.raises(UserError, match="no images"):
    list(restored.engine.generate(ids, 2))          # placeholders without their images
  with pytest.raises(UserError, match="no vision tower"):
    prompt_ids(Restored(TEXT, None, TOK, 0), "x", paths)
  with pytest.raises(UserError, match="not a readable image"):
    (tmp_path / "junk.png").write_bytes(b"not a png")
    prompt_ids(restored, "x", [str(tmp_path / "junk.png")])
