"""What both released layouts share: a builder that turns (tensor name, variable path, kind)
into Entries with their disk shapes. Where a decoder layer's variables live in the model
state (scanned units stack their layers on a leading axis) is the stack plan's
(k3_jax/stack.py: LayerSpec.path and .lead)."""

from __future__ import annotations

import functools
import math
import types
from typing import Mapping

import numpy as np

from flax import nnx

from k3_jax.checkpoint.layouts.entry import Entry, LayoutError, Tensor, st_dtype
from k3_jax.config import ModelConfig


@functools.lru_cache(maxsize=8)
def variable_shapes(cfg: ModelConfig) -> Mapping[tuple, tuple[tuple[int, ...], object]]:
  """path -> (shape, dtype) of every variable of the model (parameters and router biases),
  from the abstract model: no allocation. Cached per config (read-only): an import asks for
  it several times, and tracing the abstract model of a large config takes seconds."""
  from k3_jax.model import abstract_model
  state = nnx.state(abstract_model(cfg))
  return types.MappingProxyType(
      {tuple(p): (tuple(v.shape), v.dtype) for p, v in nnx.to_flat_state(state)})


class Builder:
  """Collects Entries. dtype_of(path, kind) -> the safetensors dtype to store, or None:
  the variable's own dtype (lossless)."""

  def __init__(self, cfg: ModelConfig, dtype_of):
    self.cfg = cfg
    self.shapes = variable_shapes(cfg)
    self.dtype_of = dtype_of
    self.entries: list[Entry] = []

  def trailing_shape(self, path, index) -> tuple[int, ...]:
    if path not in self.shapes:
      raise LayoutError(f"model has no variable {'/'.join(map(str, path))}")
    return self.shapes[path][0][len(index):]

  def add(self, name: str, path: tuple, index: tuple = (), kind: str = "linear", n_in: int = 1,
          disk_shape: tuple | None = None, dtype: str | None = None) -> None:
    path = tuple(path)
    shape = self.trailing_shape(path, index)
    dtype = dtype or (self.dtype_of and self.dtype_of(path, kind)) or st_dtype(
        self.shapes[path][1])
    if kind == "linear":
      tensors = (Tensor(name, (math.prod(shape[n_in:]), math.prod(shape[:n_in])), dtype),)
    elif kind == "conv":
      w = shape[0]
      tensors = (Tensor(name, (math.prod(shape[1:]), 1, w), dtype),)
    elif kind == "mxfp4":
      n, m = shape                                    # [in, out]
      if n % 32:
        raise LayoutError(f"{name}: MXFP4 needs the input width ({n}) to be a multiple of 32")
      tensors = (Tensor(name + "_packed", (m, n // 2), "U8"),
                 Tensor(name + "_scale", (m, n // 32), "U8"))
    elif kind == "named":
      raise ValueError("named entries are added with add_named")
    else:
      disk_shape = tuple(shape if disk_shape is None else disk_shape)
      if math.prod(disk_shape) != math.prod(shape):
        raise LayoutError(f"{name}: disk shape {disk_shape} does not hold {shape}")
      tensors = (Tensor(name, disk_shape, dtype),)
    self.entries.append(Entry(path, tuple(index), kind, tensors, n_in))


  def add_named(self, transform, prefix: tuple = ()) -> None:
    """A variable whose released tensors a names Entry (k3_jax/vision/names.py) describes:
    tensor names and the transforms both ways; the disk shapes are found by running the
    transform on a zero-stride stand-in of the variable (nothing allocated)."""
    path = tuple(prefix) + tuple(transform.path)
    shape = self.trailing_shape(path, ())
    dtype = st_dtype(self.shapes[path][1])
    stand_in = np.broadcast_to(np.zeros((), np.float32), shape)
    disk = [np.shape(a) for a in transform.from_ours(stand_in)]
    tensors = tuple(Tensor(n, tuple(int(d) for d in s), dtype)
                    for n, s in zip(transform.names, disk))
    self.entries.append(Entry(path, (), "named", tensors, transform=transform))


def param_st_dtype(cfg: ModelConfig) -> str:
  """The safetensors dtype of the model's parameters: F32 or BF16 (lossless either way)."""
  return "F32" if cfg.param_dtype == "float32" else "BF16"


def dense_prefix(cfg: ModelConfig) -> int:
  """first_k_dense_replace: the dense layers must be exactly layers 1..k."""
  k = len(cfg.dense_layers)
  if tuple(sorted(cfg.dense_layers)) != tuple(range(1, k + 1)):
    raise LayoutError(f"dense_layers={cfg.dense_layers}: the released configs express only "
                      f"a leading run of dense layers (1..k, first_k_dense_replace)")
  return k
