"""Grouped matmul with MXFP4 expert weights: the plain-JAX reference.

`mxfp4_gmm(lhs, rhs, group_sizes)` has the semantics of the Pallas kernel
`pallas_kernels.mxfp4_gmm.mxfp4_gmm` (same signature, minus the kernel's tiling and
interpret options): dequantize, then `jax.lax.ragged_dot`.

    lhs          [M, L] float, or an MXFP8 MXArray ("mxfp8_e4m3" / "mxfp8_e5m2", axis -1)
    rhs          MXFP4 MXArray of logical shape [E, L, F], blocked along L (axis 1 / -2):
                 codes [E, L/2, F] uint8, scales [E, L/32, F] uint8
    group_sizes  [E] int; rows grouped contiguously by expert, sum <= M
    returns      [M, F] in preferred_element_type (default: the lhs dtype; BF16 for MXFP8);
                 rows past sum(group_sizes) are 0

Both operands enter the matmul as BF16 with a float32 result, as on the MXU: dequantized
MX values are exact in BF16 (E2M1 has 2 significant bits, E4M3 4, E5M2 3, times a power
of two), while a float32 lhs is rounded to BF16 here exactly as the kernel rounds it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3_jax.ops.mx import MXArray, dequantize


def mxfp4_gmm(lhs: jax.Array | MXArray, rhs: MXArray, group_sizes: jax.Array, *,
              preferred_element_type=None) -> jax.Array:
  """Reference grouped matmul lhs [M, L] x dequantize(rhs) [E, L, F] -> [M, F]."""
  if not isinstance(rhs, MXArray) or rhs.fmt != "mxfp4" or rhs.codes.ndim != 3 or \
     rhs.axis not in (1, -2):
    raise ValueError("rhs must be an 'mxfp4' MXArray of shape [E, L, F] blocked along L "
                     f"(axis 1); got {type(rhs).__name__}"
                     + (f" fmt={rhs.fmt!r} axis={rhs.axis}" if isinstance(rhs, MXArray) else ""))
  if isinstance(lhs, MXArray):
    if not lhs.fmt.startswith("mxfp8") or lhs.axis not in (1, -1):
      raise ValueError(f"an MX lhs must be MXFP8 blocked along its last axis; got "
                       f"fmt={lhs.fmt!r} axis={lhs.axis}")
    x = dequantize(lhs, jnp.bfloat16)                                   # [M, L]
    out_dtype = preferred_element_type or jnp.bfloat16
  else:
    x = lhs.astype(jnp.bfloat16)                                        # [M, L]
    out_dtype = preferred_element_type or lhs.dtype
  w = dequantize(rhs, jnp.bfloat16)                                     # [E, L, F]
  out = jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32),
                           preferred_element_type=jnp.float32)          # [M, F]
  return out.astype(out_dtype)


__all__ = ["mxfp4_gmm"]
