"""Generation with images: a prompt with images (what `generate --image` runs), and greedy
captions of held-out `shapes` images scored against their labels (the multimodal training
run's accuracy measure)."""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3_jax.config import ModelConfig
from k3_jax.data import images as im
from k3_jax.data import shapes
from k3_jax.data.tokenizers import Tokenizer
from k3_jax.model import check_tokens, decode_step, prefill
from k3_jax.serve.sampling import sample


def image_prompt(cfg: ModelConfig, tokenizer: Tokenizer, prompt: str,
                 image_paths: Sequence[str]) -> tuple[list[int], dict]:
  """The images (each as media tokens around its placeholders), then the prompt text
  -> (ids, packed images). Bad images and a model without a tower are clear errors."""
  if cfg.vision is None:
    raise ValueError(f"model {cfg.name!r} has no vision tower (trained without images); "
                     "--image needs a model trained with one, e.g. --dataset=shapes")
  return im.prompt_with_images("", image_paths, prompt, cfg.vision, tokenizer.encode)


def generate_ids_with_images(cfg: ModelConfig, graphdef, params, rest, prompt_ids,
                             images: dict, max_new_tokens: int, temperature: float = 0.0,
                             top_p: float = 1.0, seed: int = 0, stop_ids=()) -> Iterator[int]:
  """Token ids sampled after `prompt_ids`, whose image placeholders take the features of the
  packed `images` (k3_jax/data/images.pack_images; their count is checked before any work):
  one prefill with the images, then one decode step per token (single request; the batched
  serving engine is text-only)."""
  if cfg.vision is None:
    raise ValueError(f"{cfg.name} has no vision tower: it cannot take images")
  prompt = check_tokens(prompt_ids, cfg).reshape(1, -1)
  im.check_placeholders(prompt, int(images["merge_idx"].shape[0]), cfg.vision)
  total = prompt.shape[1] + max_new_tokens
  if total > cfg.max_seq_len:
    raise ValueError(f"prompt ({prompt.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) "
                     f"exceeds max_seq_len={cfg.max_seq_len}")
  logits, cache = _image_prefill(graphdef, total)(params, rest, jnp.asarray(prompt), images)
  key = jax.random.key(seed)
  key, sub = jax.random.split(key)
  token = sample(sub, logits[:, -1], temperature, top_p)
  step = _decode(graphdef)
  for i in range(max_new_tokens):
    tid = int(token[0])
    yield tid
    if tid in stop_ids or i == max_new_tokens - 1:
      return
    key, sub = jax.random.split(key)
    token, cache = step(params, rest, cache, token, sub, jnp.float32(temperature),
                        jnp.float32(top_p))


@functools.lru_cache(maxsize=8)
def _image_prefill(graphdef, total: int):
  return jax.jit(lambda params, rest, tokens, images: prefill(
      nnx.merge(graphdef, params, rest), tokens, total, images))


@functools.lru_cache(maxsize=8)
def _decode(graphdef):
  def step(params, rest, cache, token, key, temperature, top_p):
    logits, cache = decode_step(nnx.merge(graphdef, params, rest), cache, token)
    return sample(key, logits, temperature, top_p), cache
  return jax.jit(step, donate_argnums=(2,))


def generate_with_images(engine, tokenizer: Tokenizer, prompt: str, image_paths: Sequence[str],
                         max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                         seed: int = 0, stop_ids=()) -> Iterator[int]:
  """Token ids sampled after the images and prompt (see `image_prompt`), with the weights of
  `engine` (a serve.engine.Engine)."""
  ids, packed = image_prompt(engine.cfg, tokenizer, prompt, image_paths)
  return generate_ids_with_images(engine.cfg, engine.graphdef, engine.params, engine.rest, ids,
                                  packed, max_new_tokens, temperature, top_p, seed, stop_ids)


def greedy_captions(cfg: ModelConfig, graphdef, params, rest, tokenizer: Tokenizer,
                    pictures: Sequence[np.ndarray], max_new_tokens: int = 48,
                    batch_size: int = 32) -> list[str]:
  """Greedy captions of `shapes`-sized images, `batch_size` images per prefill/decode batch."""
  v = cfg.vision
  prefix = shapes.prompt_ids(v, tokenizer)
  total = len(prefix) + max_new_tokens

  @jax.jit
  def start(params, rest, tokens, images):
    logits, cache = prefill(nnx.merge(graphdef, params, rest), tokens, total, images)
    return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache

  @jax.jit
  def step(params, rest, cache, token):
    logits, cache = decode_step(nnx.merge(graphdef, params, rest), cache, token)
    return jnp.argmax(logits, -1).astype(jnp.int32), cache

  out = []
  for lo in range(0, len(pictures), batch_size):
    chunk = list(pictures[lo:lo + batch_size])
    n = len(chunk)
    chunk += [chunk[-1]] * (batch_size - n)          # one compiled shape for every chunk
    packed = im.pack_images([im.to_patches(p, v, resize=False) for p in chunk], v)
    tokens = jnp.asarray(np.tile(np.asarray(prefix, np.int32), (batch_size, 1)))
    token, cache = start(params, rest, tokens, packed)
    produced = [np.asarray(token)]
    for _ in range(max_new_tokens - 1):
      if tokenizer.eos_id is not None and (np.stack(produced, 1) == tokenizer.eos_id).any(1).all():
        break
      token, cache = step(params, rest, cache, token)
      produced.append(np.asarray(token))
    ids = np.stack(produced, 1)[:n]
    for row in ids:
      row = row.tolist()
      if tokenizer.eos_id is not None and tokenizer.eos_id in row:
        row = row[:row.index(tokenizer.eos_id)]
      out.append(tokenizer.decode(row))
  return out


def caption_accuracy(cfg: ModelConfig, graphdef, params, rest, tokenizer: Tokenizer,
                     num_images: int = 192, seed: int = 0) -> dict:
  """Greedy captions of `num_images` held-out shapes images vs their labels: accuracy of the
  whole caption and of each attribute, with chance levels, and a few examples."""
  examples = shapes.held_out_examples(num_images, seed)
  texts = greedy_captions(cfg, graphdef, params, rest, tokenizer, [p for p, _ in examples])
  scores = [shapes.score_caption(t, lab) for t, (_, lab) in zip(texts, examples)]
  acc = {k: float(np.mean([s[k] for s in scores])) for k in shapes.CHANCE}
  return {"num_images": num_images, "accuracy": acc, "chance": dict(shapes.CHANCE),
          "examples": [{"label": lab["caption"], "generated": t}
                       for t, (_, lab) in list(zip(texts, examples))[:8]]}


def caption_eval(workdir: str, tokenizer: Tokenizer, num_images: int = 192, seed: int = 0,
                 log=print) -> dict:
  """caption_accuracy of the newest good checkpoint of a `--dataset=shapes` run (parameters
  only), written to <workdir>/caption_eval.json and summarised through `log`."""
  import json
  import os
  from k3_jax.checkpoint.inference import load_for_inference
  from sharding.mesh import make_mesh
  loaded = load_for_inference(workdir, make_mesh(devices=jax.devices()[:1]), log=log)
  res = caption_accuracy(loaded.cfg, loaded.graphdef, loaded.params, loaded.rest, tokenizer,
                         num_images=num_images, seed=seed)
  with open(os.path.join(workdir, "caption_eval.json"), "w") as f:
    json.dump(res, f, indent=1)
  acc, chance = res["accuracy"], res["chance"]
  log(f"greedy captions of {res['num_images']} held-out images: " + ", ".join(
      f"{k} {100 * acc[k]:.1f}% (chance {100 * chance[k]:.1f}%)" for k in acc))
  for ex in res["examples"][:4]:
    log(f"  {ex['label']!r} -> {ex['generated']!r}")
  return res


__all__ = ["image_prompt", "generate_ids_with_images", "caption_eval", "generate_with_images", "greedy_captions", "caption_accuracy"]
