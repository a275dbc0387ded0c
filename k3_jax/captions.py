"""Greedy captions of held-out `shapes` images scored against their labels (the multimodal
training run's accuracy measure), batched over many images with fixed shapes. Generation with
images for one prompt (`generate --image`, the server's image parts) runs on the batched
engine (serve/engine.py, generate.prompt_ids)."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3_jax.config import ModelConfig
from k3_jax.data import images as im
from k3_jax.data import shapes
from k3_jax.data.tokenizers import Tokenizer
from k3_jax.model import decode_step, prefill
from k3_jax.partitioning import SINGLE, Parallel


def greedy_captions(cfg: ModelConfig, graphdef, params, rest, tokenizer: Tokenizer,
                    pictures: Sequence[np.ndarray], max_new_tokens: int = 48,
                    batch_size: int = 32, par: Parallel = SINGLE) -> list[str]:
  """Greedy captions of `shapes`-sized images, `batch_size` images per prefill/decode batch.
  par: the parallel setup of the two steps (built here, per call; SINGLE = one device)."""
  v = cfg.vision
  prefix = shapes.prompt_ids(v, tokenizer)
  total = len(prefix) + max_new_tokens

  @jax.jit
  def start(params, rest, tokens, images):
    logits, cache = prefill(nnx.merge(graphdef, params, rest), tokens, total, images,
                            last_only=True, par=par)
    return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache

  @jax.jit
  def step(params, rest, cache, token):
    logits, cache = decode_step(nnx.merge(graphdef, params, rest), cache, token, par=par)
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


__all__ = ["caption_eval", "greedy_captions", "caption_accuracy"]
