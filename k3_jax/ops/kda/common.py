"""What every KDA implementation shares (the references in this package and the Pallas
kernels in pallas_kernels/): the public constants, the default scale, the document index of
packed sequences, and the shape checks. Kernels import from here only.

Layout (flash-linear-attention's):
  q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state [B, H, K, V] float32;
  segment_ids [B, T] int. Decode: the same without T.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3_jax.config import KDA_BACKENDS
from k3_jax.ops.segments import doc_index

# The chunked forms clamp the per-step log decay at G_CLAMP: a channel decayed by
# exp(-16) ~ 1.1e-7 in one step is (to float32 precision, eps = 6e-8) already erased, so the
# clamp changes outputs and states by at most ~1e-7 of the state's magnitude, and gradients
# w.r.t. g below the clamp (true size ~e^g) become 0. It bounds the log decay over a
# SUB_TILE of tokens by 16 * SUB_TILE = 64, so exp(+-64) stays far inside float32 range
# (also in the backward pass), which lets every score block be a dense matmul with no
# pairwise [C, C, K] exponent tensor.
G_CLAMP = -16.0
TILE = 16         # level-1 tiles of a chunk: score blocks between different tiles
SUB_TILE = 4      # level-2 sub-tiles: score blocks inside a tile
BACKENDS = KDA_BACKENDS     # "auto" | "reference" | "pallas" (the job's kda_backend, execution.py)


def default_scale(scale: float | None, k_dim: int) -> float:
  """The query scale: K^-1/2 unless given."""
  return k_dim ** -0.5 if scale is None else scale


def pad_time(x: jax.Array, pad: int, axis: int = 1, mode: str = "constant"):
  """x with `pad` entries appended along `axis` (zeros, or mode="edge": the last one)."""
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, mode=mode)


def check_chunk_shapes(q, k, v, g, beta, initial_state=None, segment_ids=None,
                       chunk_size: int = 64) -> tuple[int, int, int, int, int]:
  """Raises ValueError naming the first argument whose shape does not fit q [B, T, H, K]
  and v [..., V]; returns (B, T, H, K, V)."""
  if q.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q and v must be [B, T, H, K] / [B, T, H, V]; got q {tuple(q.shape)}, "
                     f"v {tuple(v.shape)}")
  B, T, H, K = q.shape
  V = v.shape[-1]
  if int(chunk_size) <= 0:
    raise ValueError(f"chunk_size must be positive, got {chunk_size}")
  _check((("k", k, (B, T, H, K)), ("g", g, (B, T, H, K)), ("v", v, (B, T, H, V)),
          ("beta", beta, (B, T, H)), ("initial_state", initial_state, (B, H, K, V)),
          ("segment_ids", segment_ids, (B, T))), q, v)
  return B, T, H, K, V


def check_decode_shapes(q, k, v, g, beta, state) -> tuple[int, int, int, int]:
  """The decode step's shapes (q [B, H, K], v [B, H, V]); returns (B, H, K, V)."""
  if q.ndim != 3 or v.ndim != 3:
    raise ValueError(f"decode: q and v must be [B, H, K] / [B, H, V]; got q "
                     f"{tuple(q.shape)}, v {tuple(v.shape)}")
  B, H, K = q.shape
  V = v.shape[-1]
  _check((("k", k, (B, H, K)), ("g", g, (B, H, K)), ("v", v, (B, H, V)),
          ("beta", beta, (B, H)), ("state", state, (B, H, K, V))), q, v)
  return B, H, K, V


def _check(items, q, v) -> None:
  for name, x, want in items:
    if x is not None and tuple(x.shape) != want:
      raise ValueError(f"KDA: {name} has shape {tuple(x.shape)}, expected {want} (from q "
                       f"{tuple(q.shape)} and v {tuple(v.shape)})")


__all__ = ["G_CLAMP", "TILE", "SUB_TILE", "BACKENDS", "default_scale", "doc_index", "pad_time",
           "check_chunk_shapes", "check_decode_shapes"]
