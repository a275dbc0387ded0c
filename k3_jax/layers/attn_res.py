"""Attention Residuals, block form (docs/architecture.md section 4).

Instead of one running residual sum, the model keeps a bank of sources:
  b_0      the token embedding output,
  b_n      the sum of all sublayer outputs of completed block n (block_size layers),
  partial  the running sum of the current block (a source only when non-empty).
Before each sublayer its input is an attention over the sources with a learned
pseudo-query w (one [D] vector per sublayer, initialised to 0 = uniform weights):

    alpha_i = softmax_i( w . RMSNorm(v_i) )       (RMSNorm without gain; FP32)
    h       = sum_i alpha_i v_i

The sublayer's output is added to `partial`; at a block boundary `partial` becomes a
new bank entry and resets. A final aggregation with its own query feeds the final norm.

The bank has a fixed shape [N_max, B, T, D] (N_max = 1 + num_layers // block_size) plus a
count of filled slots, so it lives in the scan carry and compile time does not grow with
depth. AttnRes mixes across depth for each token separately: decoding needs no cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3_jax.ops.norms import rms_norm


class PseudoQuery(nnx.Module):
  def __init__(self, dim: int):
    self.w = nnx.Param(jnp.zeros((dim,), jnp.float32), logical_axes=("embed",))

  def __call__(self, stream: dict, eps: float = 1e-5) -> jax.Array:
    return aggregate(self.w[...], stream, eps)


def bank_size(num_layers: int, block_size: int) -> int:
  return 1 + num_layers // block_size


@jax.named_scope("attn_res")
def init_stream(embedded: jax.Array, num_layers: int, block_size: int) -> dict:
  """The sources before layer 1: the embedding alone. embedded [B, T, D]."""
  n = bank_size(num_layers, block_size)
  bank = jnp.zeros((n,) + embedded.shape, embedded.dtype).at[0].set(embedded)
  return {"bank": bank,                                  # [N, B, T, D]
          "count": jnp.ones((), jnp.int32),              # filled bank slots
          "partial": jnp.zeros_like(embedded),           # [B, T, D]
          "has_partial": jnp.zeros((), jnp.bool_)}


@jax.named_scope("attn_res")
def aggregate(w: jax.Array, stream: dict, eps: float = 1e-5) -> jax.Array:
  """h = sum_i softmax_i(w . RMSNorm(v_i)) v_i over the valid sources. -> [B, T, D].

  Rematerialised: the FP32 copies of the sources and keys ([N+1, B, T, D] each, 9 x D x 8
  bytes per token for k3, at every sublayer) are recomputed in the backward pass instead of
  being kept from the forward; only the inputs (the bank in the stream dtype) are kept."""
  return _aggregate_remat(w, stream, eps)


@jax.checkpoint
def _aggregate_remat(w, stream, eps):
  return _aggregate(w, stream, eps)


def _aggregate(w: jax.Array, stream: dict, eps: float) -> jax.Array:
  sources = jnp.concatenate([stream["bank"], stream["partial"][None]], axis=0)  # [N+1,B,T,D]
  n = stream["bank"].shape[0]
  valid = jnp.concatenate([jnp.arange(n) < stream["count"], stream["has_partial"][None]])
  keys = rms_norm(sources.astype(jnp.float32), None, eps)                        # no gain
  logits = jnp.einsum("nbtd,d->nbt", keys, w.astype(jnp.float32))
  logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
  alpha = jax.nn.softmax(logits, axis=0)                                          # [N+1,B,T]
  h = jnp.einsum("nbt,nbtd->btd", alpha, sources.astype(jnp.float32))
  return h.astype(stream["partial"].dtype)


@jax.named_scope("attn_res")
def add_output(stream: dict, y: jax.Array) -> dict:
  return {**stream, "partial": stream["partial"] + y.astype(stream["partial"].dtype),
          "has_partial": jnp.ones((), jnp.bool_)}


@jax.named_scope("attn_res")
def close_block(stream: dict, is_boundary: jax.Array | bool) -> dict:
  """At a block boundary the partial sum becomes the next bank entry and resets."""
  bank = jax.lax.dynamic_update_index_in_dim(stream["bank"], stream["partial"],
                                             jnp.minimum(stream["count"],
                                                         stream["bank"].shape[0] - 1), 0)
  closed = {"bank": bank, "count": stream["count"] + 1,
            "partial": jnp.zeros_like(stream["partial"]),
            "has_partial": jnp.zeros((), jnp.bool_)}
  return jax.tree.map(lambda c, o: jnp.where(is_boundary, c, o), closed, stream)
