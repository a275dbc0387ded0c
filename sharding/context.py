"""Context parallelism: KDA, its short convolution and MLA with the sequence split over the
mesh axes that "seq" resolves to (docs/architecture.md sections 2 and 10): the `sequence` axis, and in a
batch too small for the batch axes (one 1M-token prompt) also the axes the batch left
(rules "seq"). The split of an array is always read from its resolved PartitionSpec.

Each op has the signature of its single-device reference (after the mesh argument) and is
reached from the layers through `par.ops` (the `Parallel` of sharding/install.py) when the
mesh has an axis "seq" may take. Where the sequence is not split (or too short for the
conv halo) an op falls back to its reference, which the partitioner still runs correctly.

KDA (KCP). The state recurrence is affine in the incoming state: over shard j,
    S_out = M_j S_in + S~_j,     M_j = prod_t (I - beta_t k_t k_t^T) Diag(alpha_t)   [K, K]
and token t's output is o_t = o~_t + (M_{<=t}^T q_t)^T S_in, with o~ the zero-start output
and M_{<=t} the transition up to t. One local `chunk_kda` call yields all four: run it
with K extra value columns, v_aug = [v | 0] and initial state [0 | I]. The columns evolve
independently, so the first V carry the zero-start state S~ and outputs o~, the last K carry
M (starting from I) and the outputs M_{<=t}^T q_t. Then one all-gather of [M | S~]
([B, H, K, K+V] f32 per shard, independent of T) over the sequence axis; every shard runs
the FP32 chain S <- M_j S + S~_j over the shards before it (a document that starts at a
shard's first token resets S there) and adds the correction. Documents that start inside
a shard need nothing: chunk_kda's reset zeroes the augmented columns too (M = 0 after it).
Extra cost: the value-width-dependent part of chunk_kda runs with V + K columns.

Conv halo: the causal conv of width W needs the last W - 1 inputs of the previous shard
(an all-gather of every shard's last W - 1 inputs: a few KB, and one numbering of shards
with the all-gathers above when the sequence spans several mesh axes), masked to the tokens
of the document the shard starts in.

MLA, training (plain form): the latent KV (c_kv, k_r: R + P values per token) and the
segment ids are all-gathered over the sequence axes; each shard expands them with W_kvb
and attends its local queries over all keys, masked causally by global position (query
position = shard offset + local index).

MLA, prefill (absorbed form over the cache): the cache's latents are gathered whole (R + P
values per token: 1.2 GB for 1M tokens), and each shard runs the blockwise absorbed
attention of its own queries at their global positions (ops/attention.py): no [T, S]
logits anywhere.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from k3_jax.ops import attention as attn_ops
from k3_jax.ops import conv as conv_ops
from k3_jax.ops import kda as kda_ops
from sharding.rules import RULES, logical_to_spec

_HI = jax.lax.Precision.HIGHEST


def sequence_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes (> 1) that "seq" may take; which of them split a given array depends on
  its batch (see `seq_split`)."""
  return tuple(a for a in RULES["seq"] if mesh.shape[a] > 1)


def _spec(mesh, shape, axes) -> P:
  return logical_to_spec(tuple(shape), tuple(axes), mesh)


def _names(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def seq_split(mesh: Mesh, b: int, t: int, min_local: int = 1) -> tuple[str, ...]:
  """The mesh axes splitting the time axis of a [b, t] activation (its resolved spec; in
  order, the first the most significant), or () when it is not split or a shard would
  hold fewer than min_local tokens."""
  axes = _names(_spec(mesh, (b, t), ("batch", "seq"))[1])
  p = math.prod(mesh.shape[a] for a in axes)
  return axes if axes and t // p >= min_local else ()


# ----- KDA (KCP) -------------------------------------------------------------------

def kcp_chunk_kda(mesh: Mesh, q, k, v, g, beta, scale=None, initial_state=None,
                  output_final_state=False, chunk_size=64, segment_ids=None,
                  local_fn=kda_ops.chunk_kda_reference):
  """`chunk_kda` with the time axis split over the mesh's sequence axis (KCP).

  Shapes and semantics as `k3_jax.ops.kda.chunk_kda`: q, k, g [B, T, H, K]; v [B, T, H, V];
  beta [B, T, H]; initial_state [B, H, K, V] or None; segment_ids [B, T] or None. Returns
  (o [B, T, H, V] in v.dtype, final state [B, H, K, V] f32 or None). local_fn: the
  per-shard chunked KDA (any implementation with chunk_kda's signature).
  """
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  seq = seq_split(mesh, b, t)
  if not seq:
    return local_fn(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, chunk_size=chunk_size,
                    segment_ids=segment_ids)
  p = math.prod(mesh.shape[a] for a in seq)
  tok = _spec(mesh, q.shape, ("batch", "seq", "heads", None))
  gate = _spec(mesh, beta.shape, ("batch", "seq", "heads"))
  state = _spec(mesh, (b, h, kd, vd), ("batch", "heads", None, None))
  seg_spec = _spec(mesh, (b, t), ("batch", "seq"))
  has_seg, has_init = segment_ids is not None, initial_state is not None
  args = [q, k, v, g, beta]
  specs = [tok, tok, _spec(mesh, v.shape, ("batch", "seq", "heads", None)), tok, gate]
  if has_seg:
    args.append(segment_ids)
    specs.append(seg_spec)
  if has_init:
    args.append(initial_state)
    specs.append(state)
  body = functools.partial(_kcp_local, seq=seq, p=p, scale=scale, chunk_size=chunk_size,
                           has_seg=has_seg, has_init=has_init, local_fn=local_fn)
  fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=(specs[2], state),
                     check_vma=False)
  o, final = fn(*args)
  return o, (final if output_final_state else None)


def _kcp_local(q, k, v, g, beta, *rest, seq, p, scale, chunk_size, has_seg, has_init,
               local_fn):
  """One shard: local chunked KDA with augmented columns, the all-gather, the chain."""
  rest = list(rest)
  seg = rest.pop(0) if has_seg else None
  init = rest.pop(0).astype(jnp.float32) if has_init else None
  b, t, h, kd = q.shape
  vd = v.shape[-1]
  f32 = jnp.float32
  v_aug = jnp.concatenate([v.astype(f32), jnp.zeros((b, t, h, kd), f32)], -1)  # [b,t,H,V+K]
  start = jnp.concatenate([jnp.zeros((b, h, kd, vd), f32),
                           jnp.broadcast_to(jnp.eye(kd, dtype=f32), (b, h, kd, kd))], -1)
  o_aug, s_aug = local_fn(q, k, v_aug, g, beta, scale=scale, initial_state=start,
                          output_final_state=True, chunk_size=chunk_size, segment_ids=seg)
  o_zero, q_m = o_aug[..., :vd], o_aug[..., vd:]                       # [b,t,H,V], [b,t,H,K]
  # One fixed-size all-gather: [M | S~] of every shard.
  ms = jax.lax.all_gather(jnp.concatenate([s_aug[..., vd:], s_aug[..., :vd]], -1), seq)
  if has_seg:   # does shard j start a new document (its first id != shard j-1's last)?
    ends = jax.lax.all_gather(jnp.stack([seg[:, 0], seg[:, -1]], -1), seq)   # [P, b, 2]
    resets = jnp.concatenate([jnp.zeros((1, b), bool), ends[1:, :, 0] != ends[:-1, :, 1]])
  s = init if has_init else jnp.zeros((b, h, kd, vd), f32)
  incoming = []
  for j in range(p):                                                   # FP32 chain
    if has_seg:
      s = jnp.where(resets[j][:, None, None, None], 0.0, s)
    incoming.append(s)
    s = jnp.einsum("bhij,bhjv->bhiv", ms[j, ..., :kd], s, precision=_HI) + ms[j, ..., kd:]
  me = jax.lax.axis_index(seq)
  s_in = jnp.stack(incoming)[me]                                       # [b, H, K, V]
  o = o_zero + jnp.einsum("bthk,bhkv->bthv", q_m, s_in, precision=_HI)
  return o.astype(v.dtype), s


# ----- short convolution with a halo ----------------------------------------------------

def kcp_short_conv(mesh: Mesh, x, weight, segment_ids=None, cache=None):
  """`conv_ops.short_conv` with the time axis split over the sequence axes: the window of a
  shard's first tokens reaches the previous shard's last W - 1 inputs (all-gathered).

  x [B, T, D] (D = H K, split like "heads"); weight [W, D]; segment_ids [B, T] or None;
  cache [B, W-1, D] or None (the inputs before the sequence, seen by the first shard).
  Returns (y [B, T, D], new cache [B, W-1, D]: the last shard's last W-1 inputs).
  """
  b, t, d = x.shape
  w = weight.shape[0]
  seq = seq_split(mesh, b, t, w - 1)
  if not seq:
    return conv_ops.short_conv(x, weight, segment_ids=segment_ids, cache=cache)
  p = math.prod(mesh.shape[a] for a in seq)
  x_spec = _spec(mesh, x.shape, ("batch", "seq", "heads"))
  c_spec = _spec(mesh, (b, w - 1, d), ("batch", None, "heads"))
  args, specs = [x, weight], [x_spec, _spec(mesh, weight.shape, (None, "heads"))]
  if segment_ids is not None:
    args.append(segment_ids)
    specs.append(_spec(mesh, segment_ids.shape, ("batch", "seq")))
  if cache is not None:
    args.append(cache)
    specs.append(c_spec)
  body = functools.partial(_conv_local, seq=seq, p=p, has_seg=segment_ids is not None,
                           has_cache=cache is not None)
  fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=(x_spec, c_spec),
                     check_vma=False)
  return fn(*args)


def _conv_local(x, weight, *rest, seq, p, has_seg, has_cache):
  rest = list(rest)
  seg = rest.pop(0) if has_seg else None
  cache = rest.pop(0) if has_cache else None
  w = weight.shape[0]
  me = jax.lax.axis_index(seq)
  # Every shard's last W - 1 inputs; shard i takes those of shard i - 1 (shard 0: zeros).
  tails = lambda a: jax.lax.all_gather(a[:, -(w - 1):], seq)           # [P, b, W-1, ...]
  before = lambda a: jnp.where(me == 0, jnp.zeros_like(a[0]), a[jnp.maximum(me - 1, 0)])
  x_tails = tails(x)
  halo = before(x_tails)                                               # [b, W-1, D]
  first = me == 0
  if has_cache:
    halo = jnp.where(first, cache.astype(x.dtype), halo)
  if has_seg:
    # Halo token j is in the document of this shard's first token iff no id change between
    # them: ids j..W-2 of the halo all equal the first token's id. (The cache, on shard 0,
    # belongs to the first document, as in short_conv.)
    halo_seg = before(tails(seg))                                      # [b, W-1]
    same = halo_seg == seg[:, :1]
    visible = jnp.flip(jnp.cumprod(jnp.flip(same, 1), 1), 1).astype(bool)
    visible = visible | first
    halo = jnp.where(visible[..., None], halo, jnp.zeros_like(halo))
  y, _ = conv_ops.short_conv(x, weight, segment_ids=seg, cache=halo)
  return y, x_tails[p - 1]                      # the new cache: the last shard's last inputs


# ----- MLA ------------------------------------------------------------------------------

def cp_latent_attention(mesh: Mesh, q_nope, q_rope, c_kv, k_r, w_kvb, scale, dtype,
                        q_segment_ids=None, kv_segment_ids=None, q_offset=0):
  """`k3_jax.ops.attention.latent_attention` with queries and latents split over the sequence
  axis: c_kv [B, T, R], k_r [B, T, P] (and the key segment ids) are all-gathered, each shard
  attends its queries at global positions (offset + local) over all T keys.
  Returns (o [B, T, H, V], max_logit [H] over all shards)."""
  b, t = q_nope.shape[:2]
  seq = seq_split(mesh, b, t)
  if (not seq or c_kv.shape[1] != t or q_offset != 0
      or (q_segment_ids is None) != (kv_segment_ids is None)):
    return attn_ops.latent_attention(q_nope, q_rope, c_kv, k_r, w_kvb, scale, dtype,
                                      q_segment_ids, kv_segment_ids, q_offset)
  head_spec = _spec(mesh, q_nope.shape, ("batch", "seq", "heads", None))
  lat = lambda a: _spec(mesh, a.shape, ("batch", "seq", None))
  args = [q_nope, q_rope, c_kv, k_r, w_kvb]
  specs = [head_spec, head_spec, lat(c_kv), lat(k_r),
           _spec(mesh, w_kvb.shape, (None, "heads", None))]
  has_seg = q_segment_ids is not None
  if has_seg:
    args += [q_segment_ids, kv_segment_ids]
    specs += [_spec(mesh, (b, t), ("batch", "seq"))] * 2
  body = functools.partial(_mla_local, seq=seq, reduce_axes=_names(head_spec[0]) + seq, scale=scale,
                           dtype=dtype, has_seg=has_seg)
  max_spec = P(head_spec[2])
  fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=(head_spec, max_spec),
                     check_vma=False)
  return fn(*args)


def _mla_local(q_nope, q_rope, c_kv, k_r, w_kvb, *rest, seq, reduce_axes, scale, dtype,
               has_seg):
  t = q_nope.shape[1]
  gather = lambda a: jax.lax.all_gather(a, seq, axis=1, tiled=True)
  q_seg, kv_seg = (rest[0], gather(rest[1])) if has_seg else (None, None)
  offset = jax.lax.axis_index(seq) * t
  o, max_logit = attn_ops.latent_attention(q_nope, q_rope, gather(c_kv), gather(k_r), w_kvb,
                                            scale, dtype, q_seg, kv_seg, offset)
  max_logit = jax.lax.pmax(jax.lax.stop_gradient(max_logit), reduce_axes)
  return o, max_logit


def cp_absorbed_attention(mesh: Mesh, q_latent, q_rope, c_kv, k_rope, scale, q_pos):
  """`k3_jax.ops.attention.blockwise_absorbed_attention` with the queries (and their
  positions q_pos [B, T]) split over the sequence axes: the latents [B, S, R] / [B, S, P]
  are gathered whole on every shard of a batch row, and each shard attends its own
  queries. Returns (latent output [B, T, H, R] f32, max_logit [H] over all shards)."""
  b, t = q_pos.shape
  seq = seq_split(mesh, b, t)
  if not seq:
    return attn_ops.blockwise_absorbed_attention(q_latent, q_rope, c_kv, k_rope, scale, q_pos)
  q_spec = _spec(mesh, q_latent.shape, ("batch", "seq", "heads", None))
  kv_spec = P(q_spec[0], None, None)                                   # whole length
  body = functools.partial(_absorbed_local, scale=scale,
                           reduce_axes=_names(q_spec[0]) + seq)
  fn = jax.shard_map(body, mesh=mesh,
                     in_specs=(q_spec, q_spec, kv_spec, kv_spec, P(q_spec[0], q_spec[1])),
                     out_specs=(q_spec, P(q_spec[2])), check_vma=False)
  return fn(q_latent, q_rope, c_kv, k_rope, q_pos)


def _absorbed_local(q_latent, q_rope, c_kv, k_rope, q_pos, *, scale, reduce_axes):
  o, max_logit = attn_ops.blockwise_absorbed_attention(q_latent, q_rope, c_kv, k_rope, scale,
                                                        q_pos)
  return o, jax.lax.pmax(max_logit, reduce_axes)


def parallel_ops(mesh: Mesh) -> dict:
  """The context-parallel ops when the mesh has an axis the sequence may take."""
  if not sequence_axes(mesh):
    return {}
  return {"chunk_kda": functools.partial(kcp_chunk_kda, mesh),
          "short_conv": functools.partial(kcp_short_conv, mesh),
          "latent_attention": functools.partial(cp_latent_attention, mesh),
          "absorbed_attention": functools.partial(cp_absorbed_attention, mesh)}
