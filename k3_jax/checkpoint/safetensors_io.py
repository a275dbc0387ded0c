"""Streaming safetensors: plan shards from tensor sizes alone, write them tensor by tensor,
read through the index json.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, padded with
spaces to a multiple of 8), then the raw little-endian tensor bytes back to back. Since
every tensor's size is known from its shape and dtype, the header is written first and the
tensors are produced and written one at a time: host memory holds one tensor, never a
shard or the model. Tensors are written in plan order (the order given), so the same input
gives byte-identical files.
"""

from __future__ import annotations

import collections
import json
import os
import re
import struct
from typing import Callable, Iterable

import numpy as np

from k3_jax.checkpoint.layouts.entry import NP_DTYPES, Tensor
from k3_jax.config import UserError

INDEX_NAME = "model.safetensors.index.json"


def parse_size(s: str | int) -> int:
  """'5GB' -> 5 * 10**9 (also KB, MB, TB, KiB, MiB, GiB, TiB, or plain bytes)."""
  if isinstance(s, int):
    return s
  m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", s, re.IGNORECASE)
  if not m:
    raise UserError(f"--max_shard_size={s!r}: expected a size like 5GB, 500MB or 1GiB")
  unit = (m.group(2) or "B").upper()
  mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
  n = int(float(m.group(1)) * mult)
  if n <= 0:
    raise UserError(f"--max_shard_size={s!r} must be positive")
  return n


def plan_shards(tensors: list[Tensor], max_shard_size: int) -> list[list[Tensor]]:
  """Greedy: tensors in order, a new shard when the next one would overflow (a tensor larger
  than the limit gets a shard of its own)."""
  shards: list[list[Tensor]] = [[]]
  size = 0
  for t in tensors:
    if shards[-1] and size + t.nbytes > max_shard_size:
      shards.append([])
      size = 0
    shards[-1].append(t)
    size += t.nbytes
  return shards if shards[0] else []


def shard_name(i: int, n: int) -> str:
  return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _header(tensors: list[Tensor], metadata: dict | None) -> bytes:
  head: dict = {}
  if metadata:
    head["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  off = 0
  for t in tensors:
    head[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
    off += t.nbytes
  raw = json.dumps(head, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)
  return struct.pack("<Q", len(raw)) + raw


def write_shard(path: str, tensors: list[Tensor], produce: Callable[[Tensor], np.ndarray],
                metadata: dict | None = None) -> int:
  """Writes one file; produce(t) returns t's array (called once per tensor, in order).
  Returns bytes written. Checks every produced array against its planned shape and dtype."""
  written = 0
  with open(path, "wb") as f:
    f.write(_header(tensors, metadata))
    for t in tensors:
      a = np.asarray(produce(t))
      if tuple(a.shape) != tuple(t.shape) or a.dtype != NP_DTYPES[t.dtype]:
        raise ValueError(f"{t.name}: produced {a.dtype}{list(a.shape)}, planned "
                         f"{t.dtype}{list(t.shape)}")
      buf = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
      f.write(memoryview(buf))
      written += buf.size
  return written


def write_index(out_dir: str, shards: list[list[Tensor]], metadata: dict | None = None) -> None:
  n = len(shards)
  index = {"metadata": {"total_size": sum(t.nbytes for s in shards for t in s),
                        **(metadata or {})},
           "weight_map": {t.name: shard_name(i, n) for i, s in enumerate(shards) for t in s}}
  with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
    json.dump(index, f, indent=2, sort_keys=True)
    f.write("\n")


class Reader:
  """The tensors of a Hugging Face directory (an index json with shards, or a single
  model.safetensors), opened lazily; get_slice(name) reads only what is indexed.

  safetensors maps each file into memory, and the pages read stay resident (and counted in
  the process's RSS) while the file is open: at most `max_open` files are kept open (the
  least recently used is closed), so reading a whole checkpoint holds about that many
  shards' pages, not the model's."""

  def __init__(self, directory: str, max_open: int = 2):
    from safetensors import safe_open
    self._open = lambda p: safe_open(p, framework="np")
    self.directory = directory
    index = os.path.join(directory, INDEX_NAME)
    if os.path.exists(index):
      with open(index) as f:
        self.weight_map = dict(json.load(f)["weight_map"])
    else:
      files = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))
      if not files:
        raise FileNotFoundError(f"{directory}: no {INDEX_NAME} and no .safetensors files")
      self.weight_map = {}
      for p in files:
        with self._open(os.path.join(directory, p)) as h:
          for k in h.keys():
            self.weight_map[k] = p
    self._handles: collections.OrderedDict[str, object] = collections.OrderedDict()
    self.max_open = max(1, max_open)
    self.bytes_read = 0

  def names(self) -> list[str]:
    return list(self.weight_map)

  def _handle(self, name: str):
    if name not in self.weight_map:
      raise KeyError(name)
    file = self.weight_map[name]
    if file in self._handles:
      self._handles.move_to_end(file)
    else:
      path = os.path.join(self.directory, file)
      if not os.path.exists(path):
        raise FileNotFoundError(f"{path} (listed in the index for {name}) is missing")
      while len(self._handles) >= self.max_open:
        self._handles.popitem(last=False)[1].__exit__(None, None, None)
      self._handles[file] = self._open(path).__enter__()
    return self._handles[file]

  def info(self, name: str) -> tuple[tuple[int, ...], str]:
    s = self._handle(name).get_slice(name)
    return tuple(s.get_shape()), s.get_dtype()

  def get_slice(self, name: str):
    return _CountingSlice(self, self._handle(name).get_slice(name))

  def get(self, name: str) -> np.ndarray:
    return np.asarray(self.get_slice(name)[:])

  def close(self) -> None:
    for h in self._handles.values():
      h.__exit__(None, None, None)
    self._handles.clear()


class _CountingSlice:
  def __init__(self, reader: Reader, s):
    self._reader, self._s = reader, s

  def __getitem__(self, item):
    a = self._s[item]
    self._reader.bytes_read += a.nbytes
    return a


def tensors_in(shards: Iterable[list[Tensor]]) -> list[Tensor]:
  return [t for s in shards for t in s]
