"""Kimi Delta Attention (KDA), flash-linear-attention style: one API, several forms.

Layout:
  q, k  [B, T, H, K]   queries / keys (usually L2-normalized)
  v     [B, T, H, V]   values
  g     [B, T, H, K]   per-channel log decay, g <= 0 (alpha = exp(g))
  beta  [B, T, H]      delta-rule write strength in [0, 1]
  state [B, H, K, V]   float32

Per head and per token (see docs/architecture.md section 2):
  S   <- Diag(exp(g_t)) S                     (decay the state rows)
  S   <- S + beta_t k_t (v_t - k_t^T S)^T      (delta-rule write)
  o_t  = S^T (q_t * scale)

Packed sequences: `segment_ids` [B, T] (int). A new document starts at token t whenever
segment_ids[t] != segment_ids[t-1]; the state is reset to zero before such a token, so no
information crosses a document boundary. `initial_state` applies only to the first document
of each row; the final state is the state after the last token (of the last document).
All internal math is float32; outputs have v's dtype, states are float32.

The package:
  common.py   constants (G_CLAMP, TILE, SUB_TILE, BACKENDS), default_scale, doc_index,
              pad_time, shape checks: everything the forms and the kernels share
  gate.py     the decay gates and l2_normalize
  naive.py    recurrent_kda (a scan over tokens: the definition) and kda_decode_step
  chunk.py    the chunkwise-parallel (WY / UT) form in plain JAX
  pallas_kernels/kda.py, kda_decode.py: the same signatures as Pallas TPU kernels

and the entry points here, `chunk_kda(..., backend=)` and `decode_step(..., backend=)`:
backend "reference" (the plain-JAX forms), "pallas" (the kernels; interpret mode when not
compiling for TPU) or "auto" (pallas when the compile target, `par.platform`, is TPU). They
also place the call on the mesh of `par` (k3_jax/partitioning.py; SINGLE = one device): a
kernel runs per shard (`par.shard_kernel`), and on a mesh with a sequence axis the chunked
form runs context parallel (`par.ops.chunk_kda`) with the chosen form per shard.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3_jax.ops.kda.chunk import chunk_kda as chunk_kda_reference
from k3_jax.ops.kda.common import (BACKENDS, G_CLAMP, SUB_TILE, TILE, check_chunk_shapes,
                                   check_decode_shapes, default_scale, doc_index)
from k3_jax.ops.kda.gate import kda_gate_lower_bound, kda_gate_softplus, l2_normalize
from k3_jax.ops.kda.decode_cpu import decode_step_cpu
from k3_jax.ops.kda.naive import kda_decode_step, recurrent_kda
from k3_jax.partitioning import SINGLE, Parallel

_TOK = ("batch", None, "heads", None)           # [B, T, H, X]: kernels see the whole time axis
_VEC = ("batch", None, "heads")                 # [B, T, H]
_STATE = ("batch", "heads", None, None)         # [B, H, K, V]


def resolve_backend(backend: str, par: Parallel = SINGLE) -> str:
  """"reference" or "pallas"; "auto" is pallas when compiling for TPU (par.platform)."""
  if backend not in BACKENDS:
    raise ValueError(f"KDA backend={backend!r}: expected one of {BACKENDS}")
  if backend != "auto":
    return backend
  return "pallas" if par.platform == "tpu" else "reference"


def _interpret(par: Parallel) -> bool:
  return par.platform != "tpu"


# Chunk length when the caller passes chunk_size=0 ("by backend"): the XLA reference path is
# fastest with short chunks on CPU (its intra-chunk work is O(C) per token and its tiny
# batched matmuls do not get faster with C; issue #17 measured a 15% shorter train step at
# 16 than at 64, same losses), the Pallas kernels want 64 (MXU-sized tiles).
CHUNK_BY_BACKEND = {"reference": 16, "pallas": 64}


def resolve_chunk_size(chunk_size: int, backend: str, par: Parallel = SINGLE) -> int:
  """chunk_size, or for 0 the default of the resolved backend (CHUNK_BY_BACKEND)."""
  if int(chunk_size) == 0:
    return CHUNK_BY_BACKEND[resolve_backend(backend, par)]
  return int(chunk_size)


@jax.named_scope("chunk")
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              chunk_size=64, segment_ids=None, backend: str = "reference",
              par: Parallel = SINGLE):
  """Chunked KDA by `backend` on the mesh of `par` (SINGLE: one device).
  chunk_size=0 picks the backend's default (CHUNK_BY_BACKEND); any chunk size gives the
  same result up to float32 reassociation.

  q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V] or None;
  segment_ids [B, T] int or None. Returns (o [B, T, H, V] in v.dtype, final state
  [B, H, K, V] f32, or None unless output_final_state). Equals naive.recurrent_kda up to
  float32 reassociation and the per-step decay clamp at G_CLAMP."""
  chunk_size = resolve_chunk_size(chunk_size, backend, par)
  check_chunk_shapes(q, k, v, g, beta, initial_state, segment_ids, chunk_size)
  pallas = resolve_backend(backend, par) == "pallas"
  if pallas:
    from pallas_kernels import kda as pallas_kda    # lazy: only the Pallas backend needs it
    local = functools.partial(pallas_kda.chunk_kda, interpret=_interpret(par))
  else:
    local = chunk_kda_reference
  kw = dict(scale=scale, chunk_size=chunk_size, output_final_state=output_final_state)
  kcp = par.ops.chunk_kda                 # context parallel (KCP) where the mesh splits T
  if kcp is not None and par.is_split(q.shape, ("batch", "seq", "heads", None), 1):
    return kcp(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
               local_fn=local, **kw)
  if not pallas:                          # plain JAX: the partitioner splits it
    return local(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids, **kw)
  # A Mosaic kernel cannot be partitioned: run it per shard of the mesh.
  has_state, has_seg = initial_state is not None, segment_ids is not None
  arrays, axes = [q, k, v, g, beta], [_TOK, _TOK, _TOK, _TOK, _VEC]
  for x, a in ((initial_state, _STATE), (segment_ids, ("batch", None))):
    if x is not None:
      arrays.append(x)
      axes.append(a)

  def per_shard(q, k, v, g, beta, *rest):
    s0 = rest[0] if has_state else None
    seg = rest[-1] if has_seg else None
    o, sf = local(q, k, v, g, beta, initial_state=s0, segment_ids=seg, **kw)
    return (o, sf) if output_final_state else o

  out = par.shard_kernel(per_shard, axes,
                         (_TOK, _STATE) if output_final_state else _TOK)(*arrays)
  return out if output_final_state else (out, None)


def _k_split(state: jax.Array, par: Parallel) -> bool:
  """Is a [B, H, K, V] decode state split on K on par's mesh (the serving cache's layout:
  K over the mesh axes the batch leaves unused)?"""
  if par.resolver is None:
    return False
  spec = par.resolver(state.shape, STATE_AXES).spec
  return len(spec) > 2 and spec[2] is not None


# The serving cache's names for a decode state's dimensions [B, H, K, V]
# (kv_pages.paged_cache_shardings): K ("cache_seq") takes the mesh axes the batch and the
# heads leave unused.
STATE_AXES = ("batch", "heads", "cache_seq", None)


@jax.named_scope("recurrent_step")
def decode_step(q, k, v, g, beta, state, scale=None, backend: str = "reference",
                par: Parallel = SINGLE, active=None, layer=None):
  """One token by `backend` on the mesh of `par`: q, k, g [B, H, K]; v [B, H, V]; beta
  [B, H]; state [B, H, K, V] f32. Returns (o [B, H, V] in v.dtype, new state [B, H, K, V]
  f32). active: None, or [B] bool: rows whose state changes (the others keep theirs; the
  kernel selects as it writes, in place). layer: None, or the index of this layer's state
  in a stacked `state` [R, B, H, K, V] (a scanned unit's carry), which comes back whole with
  that layer updated (the kernel in place)."""
  one = state if layer is None else jax.ShapeDtypeStruct(state.shape[1:], state.dtype)
  check_decode_shapes(q, k, v, g, beta, one)
  if resolve_backend(backend, par) == "reference" or _k_split(one, par):
    # A state split on K (a serving batch too small for the mesh: kv_pages.
    # paged_cache_shardings) runs the plain-JAX step, partitioned as it lies: each chip
    # updates its rows of K and the sums over K become all-reduces of [B, H, V]. The
    # kernel needs whole K, so it would gather every state onto every chip instead.
    if par.mesh is None and par.platform == "cpu":    # one CPU device: fewer state passes
      return decode_step_cpu(q, k, v, g, beta, state, scale, active, layer)
    old = state if layer is None else state[layer]
    o, new = kda_decode_step(q, k, v, g, beta, old, scale)
    if active is not None:
      new = jnp.where(active[:, None, None, None], new, old.astype(new.dtype))
    if layer is not None:
      new = jax.lax.dynamic_update_index_in_dim(state, new.astype(state.dtype), layer, 0)
    return o, new
  from pallas_kernels import kda_decode          # lazy: only the Pallas backend needs it
  vec = ("batch", "heads", None)
  active = jnp.ones(q.shape[:1], bool) if active is None else active
  state_axes = _STATE if layer is None else (None,) + _STATE
  step = lambda q, k, v, g, beta, state, active, *layer: kda_decode.kda_decode_step(
      q, k, v, g, beta, state, scale=scale, interpret=_interpret(par), active=active,
      layer=layer[0] if layer else None)
  lead = () if layer is None else (jnp.asarray(layer, jnp.int32),)
  return par.shard_kernel(
      step, [vec, vec, vec, vec, ("batch", "heads"), state_axes, ("batch",)] + [()] * len(lead),
      (vec, state_axes))(q, k, v, g, beta, state, active, *lead)


__all__ = ["chunk_kda", "decode_step", "resolve_backend", "resolve_chunk_size",
           "CHUNK_BY_BACKEND", "chunk_kda_reference",
           "recurrent_kda", "kda_decode_step", "l2_normalize", "kda_gate_lower_bound",
           "kda_gate_softplus", "G_CLAMP", "TILE", "SUB_TILE", "BACKENDS", "default_scale",
           "doc_index", "STATE_AXES"]
