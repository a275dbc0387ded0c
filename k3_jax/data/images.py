"""Images on the host: load (Pillow), resize to the patch grid, normalise, patchify, pack
several images into one sequence, and the text side (media tokens, placeholders).

    load_image(path)            -> RGB PIL image (clear errors: missing, unreadable, zero size)
    decode_data_url(url)        -> the same from a data:image/...;base64 URL (the server's)
    fit_grid(w, h, v)           -> (grid_h, grid_w) patches: sides multiples of merge (so the
                                   pixels are multiples of 28), at most max_side per side and
                                   max_patches in all, aspect ratio kept as well as it can be
    to_patches(image, v)        -> (patches f32 [h*w, 3*p*p], (h, w)), pixels in [-1, 1]
    pack_images([...], v)       -> the packed-images dict of k3_jax/ops/vision.py (numpy)
    image_token_ids(grid, v, encode) -> <|media_begin|>image {W}x{H}<|media_content|>
                                   + h*w/4 placeholders + <|media_end|>, as ids
    check_placeholders(tokens, n, v) -> ValueError if placeholders != features

Only this module (and the datasets built on it) touch pixels; the model sees arrays.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Sequence

import numpy as np

from k3_jax.config import UserError, VisionConfig

MEAN, STD = 0.5, 0.5          # per channel, on [0, 1] pixels (MoonViT's normalisation)


class ImageError(UserError):
  """An image that cannot be used; the message names the image and the reason (bad user
  input: the command line prints it without a traceback)."""


MAX_PIXELS = 1 << 26          # larger images are refused before decoding (64M pixels)


def load_image(path: str | os.PathLike):
  """Opens an image file as RGB. Raises ImageError for a missing, unreadable or empty file."""
  path = os.fspath(path)
  if not os.path.exists(path):
    raise ImageError(f"image {path!r}: file not found")
  return open_image(path, repr(path))


def open_image(source, name: str):
  """A file path or binary file object -> RGB PIL image; ImageError naming `name` when it is
  not a readable image, is empty, or holds more than MAX_PIXELS pixels."""
  from PIL import Image, UnidentifiedImageError
  try:
    with Image.open(source) as im:
      if im.width * im.height > MAX_PIXELS:
        raise ImageError(f"image {name}: {im.width}x{im.height} pixels, more than the "
                         f"{MAX_PIXELS:,} an image may have")
      im.load()
      img = im.convert("RGB")
  except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
    raise ImageError(f"image {name}: not a readable image ({type(e).__name__}: {e})") from e
  if img.width == 0 or img.height == 0:
    raise ImageError(f"image {name}: zero size ({img.width}x{img.height})")
  return img


def decode_data_url(url, name: str = "image_url"):
  """A `data:image/...;base64,...` URL -> RGB PIL image. Only data URLs are accepted (nothing
  is ever fetched from the network); a malformed URL, bad base64 or bytes that are not an
  image raise ImageError naming `name`."""
  import base64
  import binascii
  import io
  if not isinstance(url, str) or not url.startswith("data:"):
    shown = url[:48] + "..." if isinstance(url, str) and len(url) > 48 else url
    raise ImageError(f"{name}: only data URLs are accepted (data:image/png;base64,...); "
                     f"nothing is fetched from the network, got {shown!r}")
  head, comma, data = url[len("data:"):].partition(",")
  if not comma or not head.endswith(";base64"):
    raise ImageError(f"{name}: a data URL must read data:<media type>;base64,<data>")
  media = head[:-len(";base64")]
  if media and not media.startswith("image/"):
    raise ImageError(f"{name}: media type {media!r} is not an image")
  try:
    raw = base64.b64decode(data, validate=True)
  except (binascii.Error, ValueError) as e:
    raise ImageError(f"{name}: the data is not valid base64 ({e})") from None
  if not raw:
    raise ImageError(f"{name}: the data URL holds no bytes")
  return open_image(io.BytesIO(raw), name)


def fit_grid(width: int, height: int, v: VisionConfig) -> tuple[int, int]:
  """Patch grid (h, w) for an image of width x height pixels: each side a multiple of
  v.merge patches, <= v.max_side, h*w <= v.max_patches; scaled down (never up) only as far
  as the limits require."""
  if width <= 0 or height <= 0:
    raise ImageError(f"image of zero size ({width}x{height})")
  p, m = v.patch_size, v.merge
  side = v.max_side - v.max_side % m
  if side < m or v.max_patches < m * m:
    raise ImageError(f"vision.max_side={v.max_side} / max_patches={v.max_patches} leave no room "
                     f"for one {m}x{m} merged token")
  gh, gw = height / p, width / p
  scale = min(1.0, side / gh, side / gw, math.sqrt(v.max_patches / (gh * gw)))
  h = max(m, min(side, round(gh * scale / m) * m))
  w = max(m, min(side, round(gw * scale / m) * m))
  while h * w > v.max_patches:              # rounding up may overshoot: shrink the longer side
    if h >= w:
      h -= m
    else:
      w -= m
  return int(h), int(w)


def to_patches(image, v: VisionConfig, resize: bool = True) -> tuple[np.ndarray, tuple[int, int]]:
  """PIL image (or uint8 array [H, W, 3]) -> (patches f32 [h*w, 3*p*p], grid (h, w)).

  resize=True fits the image to the grid (`fit_grid`, bicubic); resize=False requires its
  sides to be multiples of patch*merge already and within the limits."""
  from PIL import Image
  if isinstance(image, np.ndarray):
    if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
      raise ImageError(f"image array must be uint8 [H, W, 3], got {image.dtype} {image.shape}")
    if 0 in image.shape:
      raise ImageError(f"image of zero size ({image.shape[1]}x{image.shape[0]})")
    image = Image.fromarray(image)
  p, m = v.patch_size, v.merge
  if image.width == 0 or image.height == 0:
    raise ImageError(f"image of zero size ({image.width}x{image.height})")
  if resize:
    h, w = fit_grid(image.width, image.height, v)
    if (image.width, image.height) != (w * p, h * p):
      image = image.resize((w * p, h * p), Image.Resampling.BICUBIC)
  else:
    if image.width % (p * m) or image.height % (p * m):
      raise ImageError(f"image {image.width}x{image.height}: sides must be multiples of "
                       f"{p * m} pixels without resizing")
    h, w = image.height // p, image.width // p
    check_grid((h, w), v)
  pixels = np.asarray(image.convert("RGB"), np.float32) / 255.0           # [H, W, 3]
  pixels = (pixels - MEAN) / STD
  patches = pixels.reshape(h, p, w, p, 3).transpose(0, 2, 4, 1, 3)         # [h, w, 3, p, p]
  return patches.reshape(h * w, 3 * p * p), (h, w)


def check_grid(grid: tuple[int, int], v: VisionConfig) -> None:
  h, w = grid
  if h <= 0 or w <= 0:
    raise ImageError(f"patch grid {h}x{w}: zero size")
  if h % v.merge or w % v.merge:
    raise ImageError(f"patch grid {h}x{w}: sides must be multiples of vision.merge={v.merge}")
  if max(h, w) > v.max_side:
    raise ImageError(f"patch grid {h}x{w}: a side exceeds vision.max_side={v.max_side} patches")
  if h * w > v.max_patches:
    raise ImageError(f"patch grid {h}x{w} = {h * w} patches exceeds the patch budget "
                     f"vision.max_patches={v.max_patches}")


def pack_images(images: Sequence[tuple[np.ndarray, tuple[int, int]]], v: VisionConfig,
                max_total_patches: int | None = None, pad_to: int | None = None) -> dict:
  """Packs (patches [h*w, P], (h, w)) pairs into one sequence (the dict of k3_jax/ops/vision.py,
  numpy). pad_to: pad the patch axis to this many (segment id 0) so batches of different
  packings share one compiled shape; merged tokens are never padded."""
  from k3_jax.ops.vision import interp_taps, merge_taps
  if not images:
    raise ImageError("no images to pack")
  parts = {k: [] for k in ("patches", "pos_hw", "interp_idx", "interp_w", "segment_ids",
                           "merge_idx")}
  offset = 0
  for i, (patches, grid) in enumerate(images, start=1):
    check_grid(grid, v)
    h, w = grid
    if patches.shape != (h * w, 3 * v.patch_size ** 2):
      raise ImageError(f"image {i}: patches {patches.shape} do not match grid {h}x{w} "
                       f"(expected [{h * w}, {3 * v.patch_size ** 2}])")
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    idx, wts = interp_taps(h, w, v.pos_grid)
    parts["patches"].append(patches.astype(np.float32))
    parts["pos_hw"].append(np.stack([rows.ravel(), cols.ravel()], -1).astype(np.int32))
    parts["interp_idx"].append(idx)
    parts["interp_w"].append(wts)
    parts["segment_ids"].append(np.full(h * w, i, np.int32))
    parts["merge_idx"].append(merge_taps(h, w, offset, v.merge))
    offset += h * w
  budget = max_total_patches if max_total_patches is not None else pad_to
  if budget is not None and offset > budget:
    raise ImageError(f"{len(images)} images hold {offset} patches, beyond the patch budget of "
                     f"{budget}")
  out = {k: np.concatenate(vals) for k, vals in parts.items()}
  if pad_to is not None and pad_to > offset:
    extra = pad_to - offset
    pad = {"patches": np.zeros((extra, out["patches"].shape[1]), np.float32),
           "pos_hw": np.zeros((extra, 2), np.int32),
           "interp_idx": np.zeros((extra, 16), np.int32),
           "interp_w": np.zeros((extra, 16), np.float32),
           "segment_ids": np.zeros(extra, np.int32)}
    out.update({k: np.concatenate([out[k], pad[k]]) for k in pad})
  return out


def num_image_tokens(grid: tuple[int, int], v: VisionConfig) -> int:
  return grid[0] * grid[1] // (v.merge * v.merge)


def image_token_ids(grid: tuple[int, int], v: VisionConfig,
                    encode: Callable[[str], list[int]],
                    size: tuple[int, int] | None = None) -> list[int]:
  """<|media_begin|>image {W}x{H}<|media_content|> + h*w/merge^2 placeholders + <|media_end|>
  (W, H: `size`, the image's original size in pixels, as the chat format names it; without
  it the resized size)."""
  h, w = grid
  width, height = size or (w * v.patch_size, h * v.patch_size)
  header = encode(f"image {width}x{height}")
  return ([v.media_begin_id] + list(header) + [v.media_content_id]
          + [v.image_token_id] * num_image_tokens(grid, v) + [v.media_end_id])


def feature_images(packed: dict) -> np.ndarray:
  """The image (0, 1, ...) each merged feature of a packed dict comes from: [M]."""
  return packed["segment_ids"][packed["merge_idx"][:, 0]] - 1


def image_digests(packed: dict) -> list[bytes]:
  """A content hash per packed image (its patches and their grid positions), in order."""
  import hashlib
  seg = np.asarray(packed["segment_ids"])
  out = []
  for i in range(1, int(seg.max()) + 1):
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(packed["pos_hw"][seg == i]).tobytes())
    h.update(np.ascontiguousarray(packed["patches"][seg == i]).tobytes())
    out.append(h.digest())
  return out


def check_placeholders(tokens, num_features: int, v: VisionConfig) -> None:
  """The features replace the placeholders one for one; anything else is an error."""
  n = int(np.sum(np.asarray(tokens) == v.image_token_id))
  if n != num_features:
    raise ValueError(f"the text holds {n} image placeholder tokens (id {v.image_token_id}) but "
                     f"the images give {num_features} features; each image needs exactly "
                     f"h*w/{v.merge ** 2} placeholders (use image_token_ids)")


def prompt_with_images(text_before: str, image_paths: Sequence[str], text_after: str,
                       v: VisionConfig, encode: Callable[[str], list[int]]
                       ) -> tuple[list[int], dict]:
  """A prompt with images between two pieces of text -> (ids, packed images dict)."""
  if not image_paths:
    raise ImageError("no image paths given")
  loaded = [to_patches(load_image(p), v) for p in image_paths]
  ids = list(encode(text_before))
  for _, grid in loaded:
    ids += image_token_ids(grid, v, encode)
  ids += list(encode(text_after))
  packed = pack_images(loaded, v)
  check_placeholders(ids, packed["merge_idx"].shape[0], v)
  return ids, packed


__all__ = ["ImageError", "load_image", "open_image", "decode_data_url", "fit_grid", "to_patches",
           "check_grid", "pack_images",
           "num_image_tokens", "image_token_ids", "feature_images", "image_digests",
           "check_placeholders", "prompt_with_images"]
