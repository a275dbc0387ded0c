"""The KDA decode step on one CPU device, the state read twice and written once.

The reference step (naive.kda_decode_step, then the select that keeps idle rows' state)
makes about eight passes over each [B, H, K, V] f32 state on XLA:CPU: the decay written
out, k^T S read from it, the rank-one update written, the output read from that, and the
select over old and new into the cache. The same step by the algebra of one delta-rule
token, with e = exp(g):

    S' = e S + k delta^T,   delta = beta (v - (k e)^T S)
    o  = S'^T q = ((q e)^T S) + (q . k) delta

so both k^T(eS) and (eS)^T q come from the old state in one batched matvec (two queries),
and the new state is one elementwise pass (old state in, new state out; idle rows keep
theirs, selected in the same pass). Same values as the
reference up to float rounding (the products associate differently: ~1e-7 of the values,
asserted within 1e-5 of the largest entry in tests/ops/test_kda_decode_cpu.py); each row's
result depends on its row only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3_jax.ops.kda.common import default_scale


def decode_step_cpu(q, k, v, g, beta, state, scale=None, active=None, layer=None):
  """`decode_step`'s reference path on one CPU device, same arguments and results: q, k, g
  [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V] f32 (or stacked [R, ...] with
  `layer`, updated at that index); active [B] bool or None (idle rows keep their state)
  -> (o [B, H, V] in v.dtype, new state)."""
  f32 = jnp.float32
  old = (state if layer is None else state[layer]).astype(f32)
  scale = default_scale(scale, q.shape[-1])
  q, k, v, g, beta = (a.astype(f32) for a in (q, k, v, g, beta))
  q = q * scale
  e = jnp.exp(g)                                                      # [B, H, K]
  both = jnp.einsum("bhik,bhkv->bhiv", jnp.stack([k * e, q * e], axis=2), old)  # [B, H, 2, V]
  pred, o_old = both[:, :, 0], both[:, :, 1]
  delta = beta[..., None] * (v - pred)                                # [B, H, V]
  o = o_old + jnp.sum(q * k, axis=-1, keepdims=True) * delta
  new = e[..., None] * old + k[..., None] * delta[..., None, :]
  if active is not None:            # idle rows keep theirs (the same elementwise pass)
    new = jnp.where(active[:, None, None, None], new, old)
  if layer is not None:
    new = jax.lax.dynamic_update_index_in_dim(state, new.astype(state.dtype), layer, 0)
  return o.astype(v.dtype), new


__all__ = ["decode_step_cpu"]
