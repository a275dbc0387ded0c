"""Linear projections whose weights carry logical axis names.

A weight has shape `in_shape + out_shape` and contracts the trailing `len(in_shape)` axes
of the input, so per-head projections keep their head axis ([D, H, K]) visible to the
sharding rules and to per-head optimizers.

Every weight also declares `matrix_axes`: the role of each axis for matrix optimizers
("in": fan-in, contracted with the input; "out": fan-out; "batch": an independent matrix
per index, e.g. the head axis of a per-head Q/K/V projection). k3_jax/optim reads it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3_jax.layers.init import Init


class Linear(nnx.Module):
  """y = x . W with W [*in_shape, *out_shape]; no bias (K3 uses none)."""

  def __init__(self, in_shape, out_shape, axes: tuple[str, ...], *, init: Init,
               dtype=jnp.float32, param_dtype=jnp.float32, std: float | None = None,
               batch_axes: tuple[str, ...] = ()):
    """batch_axes: logical axes of the weight that hold independent matrices (the "heads"
    axis of the Q, K and V projections, orthogonalized per head by Per-Head Muon)."""
    in_shape = (in_shape,) if isinstance(in_shape, int) else tuple(in_shape)
    out_shape = (out_shape,) if isinstance(out_shape, int) else tuple(out_shape)
    if len(axes) != len(in_shape) + len(out_shape):
      raise ValueError(f"Linear: {len(axes)} axis names {axes} for weight shape "
                       f"{in_shape + out_shape}")
    self.in_shape, self.out_shape, self.dtype = in_shape, out_shape, dtype
    std = math.prod(in_shape) ** -0.5 if std is None else std
    roles = tuple("batch" if a in batch_axes else "in" if i < len(in_shape) else "out"
                  for i, a in enumerate(axes))
    self.w = nnx.Param(init.normal(in_shape + out_shape, std, param_dtype),
                       logical_axes=tuple(axes), matrix_axes=roles)

  def __call__(self, x: jax.Array) -> jax.Array:
    n_in = len(self.in_shape)
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    y = jax.lax.dot_general(x.astype(self.dtype), self.w[...].astype(self.dtype),
                            (contract, ((), ())), preferred_element_type=jnp.float32)
    return y.astype(self.dtype)


SMALL_ROWS = 64   # inputs of at most this many rows (decode) skip the stacking


def few_rows(x: jax.Array, par) -> bool:
  """Does x [B, T, ...] hold at most SMALL_ROWS tokens in the decode layout of a batch that
  fills the mesh (`par.batch_fills_mesh`)? There the node decode moves the step's few tokens
  to the weights' splits rather than the weights (layers/kda.py, layers/mla.py; the weights
  so split: k3_jax/compile.py weights_by_output's `rows`)."""
  return par.batch_fills_mesh and x.shape[0] * x.shape[1] <= SMALL_ROWS


def apply_stacked(x: jax.Array, linears, small_rows: int = SMALL_ROWS) -> list[jax.Array]:
  """[lin(x) for lin in linears] as ONE matmul: the weights (same in/out shapes and dtype)
  are stacked on a new output axis ([*in, n, *out]), so the projections of one input read
  x once and their backward pass is one dx matmul instead of n plus n-1 adds. The
  parameters stay separate (checkpoints, sharding rules and per-head optimizers see the
  same Linears); each output element is the same dot product as lin(x). An input of at most
  `small_rows` rows (a decode step) runs the Linears one by one instead: no per-call copy of
  the weights (0: always stacked)."""
  first = linears[0]
  for lin in linears[1:]:
    if (lin.in_shape, lin.out_shape, lin.dtype) != (first.in_shape, first.out_shape,
                                                     first.dtype):
      raise ValueError(f"apply_stacked: {lin.in_shape}->{lin.out_shape} ({lin.dtype}) vs "
                       f"{first.in_shape}->{first.out_shape} ({first.dtype})")
  n_in, n_out = len(first.in_shape), len(first.out_shape)
  if x.size // math.prod(first.in_shape) <= small_rows:
    return [lin(x) for lin in linears]     # a decode step: no per-call copy of the weights
  w = jnp.stack([lin.w[...].astype(first.dtype) for lin in linears], axis=n_in)
  contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
  y = jax.lax.dot_general(x.astype(first.dtype), w, (contract, ((), ())),
                          preferred_element_type=jnp.float32).astype(first.dtype)
  # y [..., n, *out]
  return [y[(..., i) + (slice(None),) * n_out] for i in range(len(linears))]

