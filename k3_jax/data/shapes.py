"""`--dataset=shapes`: a synthetic image-captioning dataset drawn on the fly, no download.

Each example is one image with one coloured shape at a random position and size on a
random light background, and its caption, e.g. "a red square at the top left":

    <|media_begin|>image 112x112<|media_content|> [image] x 16 <|media_end|> caption <eos>

4 colours x 3 shapes x 4 positions = 48 captions (chance: 1/48 for a whole caption; 1/4,
1/3, 1/4 per attribute). The loss covers the caption and end-of-text tokens only.

Batch (numpy): the text keys of k3_jax/data/pipeline.py ([B, S] each) plus "images", the
packed-images dict of k3_jax/ops/vision.py holding the B images in row order. Example i of
a stream is drawn from (seed, i) alone, so an iterator's state is its position and resuming
is exact; evaluation uses another seed (held-out images).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from k3_jax.config import UserError, VisionConfig
from k3_jax.data import images as im
from k3_jax.data.tokenizers import Tokenizer

COLORS = {"red": (215, 40, 40), "green": (40, 165, 60), "blue": (45, 80, 220),
          "yellow": (225, 195, 30)}
SHAPES = ("square", "circle", "triangle")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
IMAGE_PX = 112                 # 8 x 8 patches of 14 -> 16 tokens after the 2 x 2 merge
EVAL_SEED_OFFSET = 10_000


def draw(rng: np.random.Generator, size: int = IMAGE_PX) -> tuple[np.ndarray, dict]:
  """-> (uint8 image [size, size, 3], {"color", "shape", "position", "caption"})."""
  from PIL import Image, ImageDraw
  color = list(COLORS)[rng.integers(len(COLORS))]
  shape = SHAPES[rng.integers(len(SHAPES))]
  pos = int(rng.integers(len(POSITIONS)))
  bg = tuple(int(c) for c in rng.integers(200, 256, 3))
  img = Image.new("RGB", (size, size), bg)
  half = size // 2
  s = int(rng.integers(size // 7, size * 5 // 14 + 1))           # 16..40 px at 112
  x0 = (pos % 2) * half + int(rng.integers(2, half - s - 1))
  y0 = (pos // 2) * half + int(rng.integers(2, half - s - 1))
  d = ImageDraw.Draw(img)
  box = (x0, y0, x0 + s, y0 + s)
  if shape == "square":
    d.rectangle(box, fill=COLORS[color])
  elif shape == "circle":
    d.ellipse(box, fill=COLORS[color])
  else:
    d.polygon([(x0 + s / 2, y0), (x0, y0 + s), (x0 + s, y0 + s)], fill=COLORS[color])
  arr = np.asarray(img, np.int16) + rng.integers(-6, 7, (size, size, 3))   # a little noise
  label = {"color": color, "shape": shape, "position": POSITIONS[pos],
           "caption": f"a {color} {shape} at the {POSITIONS[pos]}"}
  return np.clip(arr, 0, 255).astype(np.uint8), label


def prompt_ids(v: VisionConfig, tokenizer: Tokenizer) -> list[int]:
  """The image part of every example (all images have the same size)."""
  grid = (IMAGE_PX // v.patch_size, IMAGE_PX // v.patch_size)
  return im.image_token_ids(grid, v, tokenizer.encode)


def min_seq_len(v: VisionConfig, tokenizer: Tokenizer) -> int:
  longest = max(len(tokenizer.encode(f"a {c} {s} at the {p}"))
                for c in COLORS for s in SHAPES for p in POSITIONS)
  return len(prompt_ids(v, tokenizer)) + longest + (tokenizer.eos_id is not None) - 1


def check_seq_len(seq_len: int, v: VisionConfig, tokenizer: Tokenizer) -> None:
  """A UserError (a ValueError) when an example, the image's tokens and the longest
  caption, does not fit in seq_len."""
  need = min_seq_len(v, tokenizer)
  if seq_len < need:
    raise UserError(f"seq_len={seq_len} is too short for the shapes dataset: an example "
                    f"needs {need} (the image's {len(prompt_ids(v, tokenizer))} tokens and "
                    "the caption)")


def make_batch(rng_seed: int, start: int, batch_size: int, seq_len: int, v: VisionConfig,
               tokenizer: Tokenizer) -> tuple[dict, list[dict]]:
  """Examples start .. start+batch_size-1 of the stream `rng_seed` -> (batch, labels)."""
  check_seq_len(seq_len, v, tokenizer)
  prefix = prompt_ids(v, tokenizer)
  eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
  rows = np.zeros((batch_size, seq_len + 1), np.int32)
  seg = np.zeros((batch_size, seq_len + 1), np.int32)
  loss = np.zeros((batch_size, seq_len), np.float32)
  pics, labels = [], []
  for b in range(batch_size):
    img, label = draw(np.random.default_rng([rng_seed, start + b]))
    ids = prefix + tokenizer.encode(label["caption"]) + eos
    rows[b, :len(ids)], seg[b, :len(ids)] = ids, 1
    loss[b, len(prefix) - 1:len(ids) - 1] = 1.0          # predict the caption and eos
    pics.append(im.to_patches(img, v, resize=False))
    labels.append(label)
  batch = {"inputs": rows[:, :-1], "targets": np.where(seg[:, 1:] > 0, rows[:, 1:], 0),
           "segment_ids": seg[:, :-1], "loss_mask": loss,
           "images": im.pack_images(pics, v)}
  return batch, labels


class ShapesIterator:
  """Endless batches; state = position in the stream (exact resume)."""

  def __init__(self, batch_size: int, seq_len: int, v: VisionConfig, tokenizer: Tokenizer,
               seed: int = 0, process_index: int = 0):
    self.args = (batch_size, seq_len, v, tokenizer)
    self.seed = [seed, process_index]
    self.index = 0
    self._fingerprint = {"dataset": "shapes", "batch_size": batch_size, "seq_len": seq_len,
                         "seed": seed, "process_index": process_index}

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    batch_size, seq_len, v, tok = self.args
    batch, _ = make_batch(_seed(self.seed), self.index, batch_size, seq_len, v, tok)
    self.index += batch_size
    return batch

  def get_state(self) -> dict[str, Any]:
    return {"fingerprint": dict(self._fingerprint), "index": self.index}

  def set_state(self, state: dict[str, Any]) -> None:
    if state.get("fingerprint") != self._fingerprint:
      raise UserError("data iterator state is from a different pipeline: saved "
                       f"{state.get('fingerprint')}, this one {self._fingerprint}")
    self.index = int(state["index"])


def _seed(parts) -> int:
  return int(np.random.SeedSequence(parts).generate_state(1)[0])


def eval_batches(batch_size: int, seq_len: int, v: VisionConfig, tokenizer: Tokenizer,
                 num_batches: int, seed: int = 0) -> list[dict]:
  """Held-out batches (a seed the training stream never uses)."""
  s = _seed([seed + EVAL_SEED_OFFSET, 0])
  return [make_batch(s, i * batch_size, batch_size, seq_len, v, tokenizer)[0]
          for i in range(num_batches)]


def held_out_examples(n: int, seed: int = 0) -> list[tuple[np.ndarray, dict]]:
  """n held-out (image, label) pairs for caption accuracy (the eval stream's images)."""
  s = _seed([seed + EVAL_SEED_OFFSET, 1])
  return [draw(np.random.default_rng([s, i])) for i in range(n)]


def score_caption(text: str, label: dict) -> dict[str, bool]:
  """Exact caption match and each attribute named correctly (and no other of its kind)."""
  words = text.strip()
  def only(options, want):
    found = [o for o in options if o in words]
    return found == [want]
  return {"caption": words == label["caption"],
          "color": only(list(COLORS), label["color"]),
          "shape": only(SHAPES, label["shape"]),
          "position": only(POSITIONS, label["position"])}


CHANCE = {"caption": 1 / (len(COLORS) * len(SHAPES) * len(POSITIONS)), "color": 1 / len(COLORS),
          "shape": 1 / len(SHAPES), "position": 1 / len(POSITIONS)}

__all__ = ["draw", "make_batch", "ShapesIterator", "eval_batches", "held_out_examples",
           "score_caption", "prompt_ids", "min_seq_len", "CHANCE", "COLORS", "SHAPES",
           "POSITIONS"]
