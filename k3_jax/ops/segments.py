"""Packed sequences: document numbers from segment ids (shared by the KDA forms, the short
convolution and the Pallas kernels).

A new document starts at token t whenever segment_ids[t] != segment_ids[t-1].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def doc_index(segment_ids: jax.Array) -> jax.Array:
  """Document number of each token: 0 for the first document, +1 per change.

  segment_ids [B, T] -> [B, T] int32."""
  change = segment_ids[:, 1:] != segment_ids[:, :-1]              # [B, T-1]
  change = jnp.concatenate(
      [jnp.zeros_like(change[:, :1]), change], axis=1)            # [B, T]
  return jnp.cumsum(change.astype(jnp.int32), axis=1)


__all__ = ["doc_index"]
