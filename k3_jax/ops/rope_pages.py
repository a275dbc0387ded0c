"""The layout of a serving pool's rope keys: each page's [P, Pr] keys folded to lane width.

An MLA page pool holds, per token, the latent [R] and the rope key [Pr] (k3: 512 and 64).
A page of rope keys [P, Pr] with Pr under the TPU's 128 lanes is not held row-major by the
TPU compiler: it puts the page's P axis minor ([Pr, P] in memory), and every row scatter of a
decode step's new keys and every read by the paged-attention kernel (which wants its block
row-major) then relays the whole stacked pool out and back (k3 v5p-128, 1,024 x 32K: ~20 GB a
chip a step; 64 x 1M: ~59 GB). A pool with the keys beside the latents, [P, R + Pr] = 576
wide, is held the same transposed way (not a multiple of 128), and its row scatter copies
the pool twice (compiled alone, a [22, 2048, 512, 576] pool: 106 GB a step against 0.07
for the 512-wide latents).

So the pool holds each page as [P / f, f Pr] with f = 128 / Pr (k3: [256, 128]): row i,
lane block j is the key of the page's position j P / f + i. That is 128 lanes wide, held
row-major, no padding; a token's write is one contiguous Pr-wide window of a row (in place),
and lane block j of a page is the keys of a contiguous run of P / f positions, which the
kernel matches with the same run of latent rows (pallas_kernels/paged_attention.py).
`unfold` gives the positions back in order ([..., P, Pr]) for the plain-JAX readers; the
values are the same bits, so a CPU program's logits do not change.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LANES = 128


def fold(rope_dim: int, page_size: int) -> int:
  """Keys per pool row: 128 / rope_dim where it divides 128 (and the page), else 1."""
  if rope_dim >= LANES or LANES % rope_dim:
    return 1
  return math.gcd(LANES // rope_dim, page_size)


def pool_shape(num_pages: int, page_size: int, rope_dim: int) -> tuple[int, int, int]:
  """[N, P / f, f Pr]: a pool of `num_pages` pages of rope keys."""
  f = fold(rope_dim, page_size)
  return num_pages, page_size // f, f * rope_dim


def fold_pages(keys: jax.Array, page_size: int | None = None) -> jax.Array:
  """Logical pages [..., P, Pr] -> the pool's layout [..., P / f, f Pr]."""
  p, pr = keys.shape[-2:]
  f = fold(pr, page_size or p)
  x = keys.reshape(keys.shape[:-2] + (f, p // f, pr))
  return jnp.swapaxes(x, -3, -2).reshape(keys.shape[:-2] + (p // f, f * pr))


def unfold(pages: jax.Array, rope_dim: int) -> jax.Array:
  """The pool's layout [..., P / f, f Pr] -> the keys in position order [..., P, Pr]."""
  n, w = pages.shape[-2:]
  f = w // rope_dim
  x = pages.reshape(pages.shape[:-2] + (n, f, rope_dim))
  return jnp.swapaxes(x, -3, -2).reshape(pages.shape[:-2] + (f * n, rope_dim))


def write(pool: jax.Array, index: tuple, off: jax.Array, keys: jax.Array) -> jax.Array:
  """pool [*L, N, P / f, f Pr] with keys [..., Pr] written at the positions `off` [...] of
  the pages `index` names: (*leading indices, page), each broadcast to off's shape. Each
  key is one contiguous Pr-wide window of a row (a scatter the TPU compiler keeps in place)."""
  n, w = pool.shape[-2:]
  pr = keys.shape[-1]
  shape = off.shape
  idx = [jnp.broadcast_to(jnp.asarray(a, jnp.int32), shape) for a in index]
  idx += [off % n, (off // n) * pr]
  if len(idx) != pool.ndim:
    raise ValueError(f"write: {len(index)} page indices for a pool of {pool.ndim} axes")
  nd = len(shape)
  dims = jax.lax.ScatterDimensionNumbers(
      update_window_dims=(nd,), inserted_window_dims=tuple(range(pool.ndim - 1)),
      scatter_dims_to_operand_dims=tuple(range(pool.ndim)))
  return jax.lax.scatter(pool, jnp.stack(idx, -1), keys.astype(pool.dtype), dims,
                         mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def fold_queries(q_rope: jax.Array, f: int) -> jax.Array:
  """q_rope [B, H, Pr] -> [B, f, H, f Pr]: block j holds q in lanes j Pr ... (j + 1) Pr and
  zeros elsewhere, so block j times a folded page's rows gives the logits of lane block j's
  positions (one matmul over the full 128 lanes, no lane slicing in the kernel)."""
  b, h, pr = q_rope.shape
  out = jnp.einsum("bhp,jk->bjhkp", q_rope, jnp.eye(f, dtype=q_rope.dtype))
  return out.reshape(b, f, h, f * pr)


__all__ = ["LANES", "fold", "pool_shape", "fold_pages", "unfold", "write", "fold_queries"]
