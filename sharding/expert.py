"""Expert parallelism: the routed-expert FFN inside `shard_map` over the expert mesh axis.

Same signature and result as `k3_jax.ops.moe.moe_dispatch` (after the mesh argument), so
the MoE layer reaches it through `par.ops.moe_dispatch` (the `Parallel` of
sharding/install.py) when the mesh has an expert axis > 1. Routing, the load counts and the
balancing-bias update stay outside, in the global (GSPMD) view, so they see the global
batch exactly as on one device (QB's quantile over all tokens; the histogram variant's
counts are summed by the partitioner's all-reduce).

Per device (P devices in the expert group, E_l = E / P experts each, n local tokens):
  1. sort the n k token-expert pairs by expert; the destination of a pair is the device
     owning its expert (pairs for one device are contiguous);
  2. one small all-gather of the per-expert pair counts [P, E] over the expert axis: every
     device then knows every send size, receive size and offset;
  3. send the pair rows to their owners:
       TPU:   `jax.lax.ragged_all_to_all` (only the real rows travel);
       other: `jax.lax.all_to_all` of a fixed [P, cap] buffer, cap = n min(k, E_l) rows per
              destination, enough for the worst case (a token picks k distinct experts, at
              most E_l of them on one device), so both paths are dropless;
  4. regroup the received rows by local expert and run the local grouped matmul
     (gate, up, SiTU/SwiGLU, down);
  5. send the results back the same way, un-sort, and combine with the router weights (f32).
The receive buffer holds P cap rows (the worst case); rows past the real ones are padding
that `ragged_dot` skips (the tiled CPU gmm computes and discards them).

Memory: the dropless worst case is P times the expected n k rows per device, and every
[rows, F] intermediate of the local FFN scales with it. `capacity_factor` c (an argument:
the MoE layer passes the job's Parallel.kernels.ep_capacity, static in the traced program)
bounds the rows per (source, destination) at
ceil(c n k / P), so the buffer holds c times the balanced load; a source's rows for one
destination beyond that (its highest-numbered experts' rows, deterministically) are dropped:
they contribute 0 to the combine. With Quantile Balancing the per-expert load of a batch is
close to n k / E, so c around 1.5-2 rarely drops; None (the default) never drops.

The ragged exchange packs what a device receives source after source (no gap per chunk),
so its buffer need not be P chunks: `recv_factor` r bounds it at ceil(r n k) rows, and
every [rows, .] buffer of the local FFN with it. The rows a device receives are the sum of
P chunks (about Poisson with mean n k), far below P times a chunk's own tail bound: a k3
decode of 1,024 sequences on 64 expert shards receives 256 rows a layer on average, and
336 cover it but for 1e-6, where P chunks hold 1,088. Every device knows every count (the
all-gather above), so all apply the same rule: a destination keeps its first `slots` rows
in source order (a chunk truncated at it keeps its lowest experts' rows), the rest are
dropped (0 in the combine), as with the chunk bound.

Replicated tokens (a decode batch smaller than the expert axis, e.g. 8 tokens on expert:64):
when no expert axis shards the tokens (`token_axes` could not use it), every device already
holds every token, and the exchange above would have each of the P devices send the same
pairs to the owners (P times the rows, each pair computed P times). Instead each device
keeps the pairs whose expert is one of its own (at most n min(k, E_l), a static bound),
orders them by local expert (stable), runs the same local grouped matmul over just those
rows, combines them with their router weights into a partial [n, D] f32 sum, and one psum
over the expert axis adds the partial sums: no all-to-all, dropless (capacity_factor does
not apply). Token axes that are not expert axes (data) still split the tokens.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from k3_jax.ops import moe as moe_ops
from k3_jax.ops.activations import glu
from k3_jax.ops.mx_gmm import StackedLayer
from k3_jax.partitioning import all_gather_in_stages
from sharding.kernels import mesh_platform
from sharding.rules import RULES

# The row multiple of the MXFP4 kernel's 8-bit (MXFP8) lhs tiles: a receive bound of at
# least 8 of them is rounded up to it (at most 1/8 more rows; k3 1,024 x 32K: 336 -> 352),
# so the kernel takes the expert buffers in one row tile, without padding them to 128 rows
# and slicing its outputs back (pallas_kernels/mxfp4_gmm.default_tiling).
ROW_ALIGN = 32

# "ragged_reference": the ragged bookkeeping with an all-gather emulation of
# ragged_all_to_all, so the CPU tests check the offsets the TPU path uses.
EXCHANGES = ("auto", "ragged", "all_to_all", "ragged_reference")

def _axes(mesh: Mesh, logical: str) -> tuple[str, ...]:
  return tuple(a for a in RULES[logical] if mesh.shape[a] > 1)


def token_axes(mesh: Mesh, n_tokens: int) -> tuple[str, ...]:
  """Mesh axes sharding a flat token dimension: those of "batch" then "seq" (the layout of
  [B, T] flattened), each kept while the product still divides n_tokens."""
  chosen, size = [], 1
  for a in _axes(mesh, "batch") + _axes(mesh, "seq"):
    if a not in chosen and n_tokens % (size * mesh.shape[a]) == 0:
      chosen.append(a)
      size *= mesh.shape[a]
  return tuple(chosen)


def expert_axes(mesh: Mesh) -> tuple[str, ...]:
  return _axes(mesh, "experts")


def expert_parallel_dispatch(mesh: Mesh, x: jax.Array, weights: jax.Array,
                             expert_ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                             w_down: jax.Array, activation: str = "situ", beta1: float = 4.0,
                             beta2: float = 25.0, gmm: moe_ops.GroupedMatmul | None = None,
                             exchange: str = "auto",
                             capacity_factor: float | None = None,
                             recv_factor: float | None = None,
                             staged_gather: bool = False) -> jax.Array:
  """Dropless routed-expert FFN with the experts sharded over the mesh's expert axis.

  x [N, Din]; weights [N, k] f32 combine weights; expert_ids [N, k] int32 (global ids);
  w_gate, w_up [E, Din, F]; w_down [E, F, Din]. Returns y [N, Din] in x.dtype, equal to
  `moe_dispatch` (each expert output is rounded to x.dtype before its trip back).
  exchange: "ragged" (ragged_all_to_all; TPU), "all_to_all" (fixed buffers; any backend) or
  "auto" (ragged on TPU meshes). gmm: the local grouped matmul; default ragged_dot on TPU,
  the tiled plain-JAX gmm elsewhere. capacity_factor: None (dropless) or c > 0: at most
  ceil(c n k / P) rows per (source, destination), the rest dropped (see the module
  docstring). recv_factor: None, or r > 0: a device receives at most ceil(r n k) rows a
  layer (its buffers and expert FFN that many rows, not P chunks; sources' rows past it, in
  source order, dropped; the ragged exchange only). When the expert axis does not split the
  tokens (N not divisible by it, a small decode batch), every device computes its own
  experts' pairs of all its tokens and the partial results are summed over the expert axis
  instead: no exchange, no rounding of the expert outputs, always dropless (`exchange`,
  `capacity_factor` and `recv_factor` are not used). staged_gather: the routing counts
  all-gathered in two stages (`partitioning.all_gather_in_stages`; the node decode's
  layout: the TPU compiler does a gather over the whole axis as an all-reduce of a
  zero-filled buffer).
  """
  if exchange not in EXCHANGES:
    raise ValueError(f"exchange={exchange!r}: expected one of {EXCHANGES}")
  platform = mesh_platform(mesh)
  if exchange == "auto":
    exchange = "ragged" if platform == "tpu" else "all_to_all"
  if gmm is None:
    gmm = moe_ops.default_gmm("ragged_dot" if platform in ("tpu", "gpu") else "tiled", platform)
  ex = expert_axes(mesh)
  p = math.prod(mesh.shape[a] for a in ex)
  e = w_gate.shape[0]
  if not ex:
    raise ValueError("expert_parallel_dispatch needs a mesh with an expert axis > 1")
  if e % p:
    raise ValueError(f"num_experts={e} is not divisible by the mesh expert axis {ex}={p}")
  n_total, k = expert_ids.shape
  tok = token_axes(mesh, n_total)
  tok_spec = P(tok or None, None)
  # A scanned layer's packed weight may come as its whole stack and the layer index
  # (k3_jax/ops/mx_gmm.StackedLayer): the stack is split on its expert axis, 1.
  w_spec = lambda w: (StackedLayer(P(None, ex, None, None), P())
                      if isinstance(w, StackedLayer) else P(ex, None, None))
  if capacity_factor is not None and not capacity_factor > 0:
    raise ValueError(f"capacity_factor={capacity_factor} must be positive (or None for "
                     "dropless)")
  if recv_factor is not None and not recv_factor > 0:
    raise ValueError(f"recv_factor={recv_factor} must be positive (or None: P chunks)")
  ffn = dict(gmm=gmm, activation=activation, beta1=beta1, beta2=beta2)
  if any(a in tok for a in ex):
    body = functools.partial(_local_dispatch, ex=ex, p=p, exchange=exchange,
                             capacity=capacity_factor, recv_bound=recv_factor,
                             staged=staged_gather, **ffn)
  else:                                     # tokens replicated over the expert axis
    body = functools.partial(_replicated_dispatch, ex=ex, **ffn)
  fn = jax.shard_map(body, mesh=mesh, in_specs=(tok_spec, tok_spec, tok_spec, w_spec(w_gate),
                                                w_spec(w_up), w_spec(w_down)),
                     out_specs=tok_spec, check_vma=False)
  with jax.named_scope("expert_parallel"):
    return fn(x, weights, expert_ids, w_gate, w_up, w_down)


def _gated(gmm, rows, w_gate, w_up, group_sizes, activation, beta1, beta2, dtype):
  """The experts' gated hidden glu(rows @ w_gate, rows @ w_up) in `dtype`: in one call
  where the grouped matmul offers it (`gmm.gated`: the MXFP4 kernel's gated call,
  ops/mx_gmm.packed_gmm, the same values: both products rounded to the lhs dtype, the same
  activation), else two grouped matmuls and the activation."""
  fused = getattr(gmm, "gated", None)
  if fused is not None:
    return fused(rows, w_gate, w_up, group_sizes, activation, beta1, beta2).astype(dtype)
  gate = gmm(rows, w_gate, group_sizes)
  up = gmm(rows, w_up, group_sizes)
  return glu(gate, up, activation, beta1=beta1, beta2=beta2).astype(dtype)


def _excl_cumsum(x, axis=0):
  return jnp.cumsum(x, axis=axis) - x


def _local_dispatch(x, weights, expert_ids, w_gate, w_up, w_down, *, ex, p, exchange, gmm,
                    capacity, activation, beta1, beta2, recv_bound=None, staged=False):
  """One device's part. x [n, D]; weights, expert_ids [n, k]; w_* the local experts."""
  n, k = expert_ids.shape
  d = x.shape[1]
  el = w_gate.shape[0]                                                 # local experts
  e = el * p
  cap = n * min(k, el)                    # rows per (src, dst): enough for the worst case
  if capacity is not None:
    cap = max(1, min(cap, math.ceil(capacity * n * k / p)))
  ragged = exchange in ("ragged", "ragged_reference")
  # The ragged exchange packs the received rows source after source (no gap per chunk), so
  # its buffer holds `slots` rows: P chunks, or fewer with a receive bound (recv_factor).
  slots = p * cap
  if recv_bound is not None and ragged:
    slots = max(1, min(slots, math.ceil(recv_bound * n * k)))
    if slots >= 8 * ROW_ALIGN:   # whole 8-bit row tiles of the MXFP4 kernel (no pad, slice)
      slots = min(p * cap, -(-slots // ROW_ALIGN) * ROW_ALIGN)
  me = jax.lax.axis_index(ex)

  # --- source side: pairs sorted by expert, i.e. grouped by destination device.
  flat = expert_ids.reshape(-1)                                        # [n k]
  order = jnp.argsort(flat, stable=True)                               # [n k]
  dest = flat[order] // el                                             # [n k] destination
  counts = jnp.bincount(flat, length=e).astype(jnp.int32)              # [E]
  gather = (functools.partial(all_gather_in_stages, size=p) if staged else jax.lax.all_gather)
  all_counts = gather(counts, ex, tiled=True).reshape(p, p, el)        # [src, dst, E_l]
  per_dst_full = per_dst = all_counts.sum(2)                           # [src, dst]
  input_offsets = _excl_cumsum(per_dst[me])                            # [P]
  pos_in_chunk = jnp.arange(n * k) - input_offsets[dest]               # [n k]
  # Rows that travel: each (src, dst) chunk truncated to cap, i.e. per expert
  # min(count, room left after the chunk's lower experts).
  all_counts = jnp.clip(cap - _excl_cumsum(all_counts, 2), 0, all_counts)
  per_dst = all_counts.sum(2)                                          # [src, dst]
  if slots < p * cap:       # a destination keeps its first `slots` rows, in source order
    per_dst = jnp.clip(slots - _excl_cumsum(per_dst, 0), 0, per_dst)
    all_counts = jnp.clip(per_dst[..., None] - _excl_cumsum(all_counts, 2), 0, all_counts)
  send_sizes = per_dst[me]                                             # [P]
  kept = pos_in_chunk < send_sizes[dest]                               # [n k] kept pairs
  xs = jnp.take(x, order // k, axis=0)                                 # [n k, D]

  # --- receive side bookkeeping: from source s come mine[s, j] rows for local expert j,
  # ordered by expert, in slots [s cap, s cap + recv_sizes[s]) (fixed chunks), or packed
  # from recv_at[s] (ragged).
  mine = jax.lax.dynamic_index_in_dim(all_counts, me, axis=1, keepdims=False)  # [src, E_l]
  recv_sizes = mine.sum(1)                                             # [P]
  recv_at = _excl_cumsum(per_dst, 0)                                   # [src, dst] packed
  slot = jnp.arange(slots)
  if ragged:
    s = jnp.searchsorted(recv_at[:, me], slot, side="right") - 1       # last source at/before
    pos = slot - recv_at[s, me]
  else:
    s, pos = slot // cap, slot % cap
  valid = pos < recv_sizes[s]                                          # [slots]
  cum = jnp.cumsum(mine, axis=1)                                       # [src, E_l]
  le = jnp.minimum(jnp.sum(cum[s] <= pos[:, None], axis=1), el - 1)    # local expert of slot
  group_sizes = mine.sum(0).astype(jnp.int32)                          # [E_l]
  within = pos - (cum[s, le] - mine[s, le])
  grouped_pos = (_excl_cumsum(group_sizes)[le] + _excl_cumsum(mine, 0)[s, le] + within)
  total = group_sizes.sum()
  pad_pos = total + jnp.cumsum(~valid) - 1
  grouped_pos = jnp.where(valid, grouped_pos, pad_pos)                 # a permutation of slots
  slot_of = jnp.zeros((slots,), jnp.int32).at[grouped_pos].set(slot.astype(jnp.int32))

  # --- forward exchange.
  ragged_a2a = (jax.lax.ragged_all_to_all if exchange == "ragged"
                else functools.partial(_ragged_all_to_all_reference, p=p))
  if ragged:
    # The receive buffer's rows past what arrives are never read as values: they sit past
    # sum(group_sizes) in the grouped order below, whose rows every grouped matmul leaves 0
    # whatever its lhs holds there (the MXFP4 kernel selects its stored rows and quantises
    # row by row; ragged_dot computes only the groups' rows), and the return exchange sends
    # only the rows that arrived. So on TPU it is not zero-filled (`lax.empty`: a buffer
    # allocated, nothing written; k3 v5p-128 1,024 x 32K: a [352, 3,584] bf16 write a
    # layer); elsewhere `lax.empty` is zeros.
    recv_buf = (jax.lax.empty((slots, d), x.dtype) if exchange == "ragged"
                else jnp.zeros((slots, d), x.dtype))
    recv = ragged_a2a(
        xs, recv_buf, input_offsets, send_sizes,
        recv_at[me].astype(jnp.int32), recv_sizes, axis_name=ex)
  else:
    to = jnp.where(kept, dest * cap + pos_in_chunk, p * cap)           # dropped: out of range
    buf = jnp.zeros((p * cap, d), x.dtype).at[to].set(xs, mode="drop")
    recv = jax.lax.all_to_all(buf, ex, 0, 0, tiled=True)               # [P cap, D]

  # --- local grouped matmul over the received rows, grouped by local expert.
  rows = jnp.take(recv, slot_of, axis=0)                               # [slots, D]
  with jax.named_scope("experts"):
    h = _gated(gmm, rows, w_gate, w_up, group_sizes, activation, beta1, beta2, x.dtype)
    out = gmm(h, w_down, group_sizes)                                  # [slots, D] f32
  # back to slot order; a slot that received nothing takes a row past sum(group_sizes),
  # which the grouped matmul left 0, and travels back nowhere (the ragged exchange sends
  # the rows that arrived, fixed chunks keep the kept pairs'): no select over the buffer
  out = jnp.take(out, grouped_pos, axis=0).astype(x.dtype)

  # --- return exchange, into the source's sorted pair order.
  if ragged:
    # My rows for source s land in its sorted array at its offset for destination me.
    # (Offsets in the source's untruncated sorted order; its kept rows are a prefix.)
    back_offsets = _excl_cumsum(per_dst_full, 1)[:, me]                # [src]
    # (on TPU not zero-filled either: a dropped pair's row is selected to 0 below, in the
    # fusion that gathers the pairs back to token order)
    back_buf = (jax.lax.empty((n * k, d), x.dtype) if exchange == "ragged"
                else jnp.zeros((n * k, d), x.dtype))
    sorted_out = ragged_a2a(
        out, back_buf, recv_at[:, me].astype(jnp.int32),
        recv_sizes, back_offsets, send_sizes, axis_name=ex)            # [n k, D]
  else:
    back = jax.lax.all_to_all(out, ex, 0, 0, tiled=True)               # [P cap, D]
    sorted_out = jnp.take(back, jnp.where(kept, dest * cap + pos_in_chunk, 0), axis=0)
    sorted_out = jnp.where(kept[:, None], sorted_out, jnp.zeros_like(sorted_out))  # [n k, D]

  inverse = jnp.argsort(order)
  pairs = jnp.take(sorted_out, inverse, axis=0).astype(jnp.float32).reshape(n, k, d)
  if exchange == "ragged":                  # dropped pairs: rows the exchange did not write
    pairs = jnp.where(jnp.take(kept, inverse).reshape(n, k, 1), pairs, 0.0)
  y = jnp.sum(pairs * weights.astype(jnp.float32)[..., None], axis=1)  # [n, D]
  return y.astype(x.dtype)


def _replicated_dispatch(x, weights, expert_ids, w_gate, w_up, w_down, *, ex, gmm,
                         activation, beta1, beta2):
  """One device's part when every device of the expert group holds the same tokens: its
  own experts' pairs only, then a psum over the expert axis. x [n, D]; weights,
  expert_ids [n, k]; w_* the local experts [E_l, ...]."""
  n, k = expert_ids.shape
  el = w_gate.shape[0]
  rows = n * min(k, el)     # local pairs at most: a token's k experts are distinct
  local = expert_ids.reshape(-1) - jax.lax.axis_index(ex) * el         # [n k]
  local = jnp.where((local >= 0) & (local < el), local, el)            # not mine: el
  order = jnp.argsort(local, stable=True)[:rows]                       # mine first, by expert
  group_sizes = jnp.bincount(local, length=el + 1)[:el].astype(jnp.int32)  # [E_l]
  valid = jnp.arange(rows) < group_sizes.sum()                         # [rows] real pairs
  token = order // k                                                   # [rows]
  xs = jnp.take(x, token, axis=0)                                      # [rows, D]
  with jax.named_scope("experts"):
    h = _gated(gmm, xs, w_gate, w_up, group_sizes, activation, beta1, beta2, x.dtype)
    out = gmm(h, w_down, group_sizes).astype(jnp.float32)              # [rows, D]
  w = jnp.take(weights.reshape(-1), order).astype(jnp.float32)         # [rows]
  # where(), not a multiply: padding rows are exactly 0 whatever gmm left in them
  contrib = jnp.where(valid[:, None], out * w[:, None], 0.0)
  y = jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(contrib)   # [n, D] partial
  return jax.lax.psum(y, ex).astype(x.dtype)


def _ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets,
                                 recv_sizes, *, axis_name, p):
  """`jax.lax.ragged_all_to_all`'s documented result, built from all-gathers (P times the
  traffic; for checking the ragged path's offsets on backends without the collective).
  Source i's slice for me, operand_i[in_i : in_i + size_i], lands at output[out_i :]."""
  del recv_sizes   # implied by the senders' sizes
  me = jax.lax.axis_index(axis_name)
  src_rows = jax.lax.all_gather(operand, axis_name)                    # [P, N, D]
  pick = lambda a: jax.lax.all_gather(a, axis_name)[:, me]             # [P] what i sends me
  in_off, size, out_off = pick(input_offsets), pick(send_sizes), pick(output_offsets)
  r = jnp.arange(output.shape[0])
  for i in range(p):
    hit = (r >= out_off[i]) & (r < out_off[i] + size[i])
    src = jnp.clip(in_off[i] + r - out_off[i], 0, operand.shape[0] - 1)
    output = jnp.where(hit[:, None], jnp.take(src_rows[i], src, axis=0), output)
  return output


def parallel_ops(mesh: Mesh, staged_gather: bool = False) -> dict:
  """{"moe_dispatch": the expert-parallel dispatch} when the mesh has an expert axis > 1
  (staged_gather: the node decode's layout, `expert_parallel_dispatch`)."""
  if not expert_axes(mesh):
    return {}
  return {"moe_dispatch": functools.partial(expert_parallel_dispatch, mesh,
                                            staged_gather=staged_gather)}
