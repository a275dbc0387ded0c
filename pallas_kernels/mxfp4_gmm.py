"""Grouped matmul with packed MXFP4 expert weights: a Pallas TPU kernel for a dropless MoE.

    out[r] = lhs[r] @ W[g]    for every row r of group g,   W = dequantize(rhs)  [E, L, F]
    out[r] = 0                for rows r >= sum(group_sizes)

Same signature and semantics as the reference `k3_jax.ops.mx_gmm.mxfp4_gmm` (dequantize,
then `jax.lax.ragged_dot`). The point is the weight traffic: the rhs stays packed in HBM
(E2M1 codes two per byte along L plus one E8M0 scale byte per 32 weights: 4.25 bits per
weight instead of 16 for BF16), each tile is unpacked and scaled in VMEM and fed to the MXU
in BF16 with FP32 accumulation. MoE decode is bound by reading expert weights, so this is
about 3.8x less of the bound.

Inputs
  lhs          [M, L] float (rounded to BF16 for the MXU), or an MXFP8 MX array
               (fmt "mxfp8_e4m3"/"mxfp8_e5m2", blocks along L: codes [M, L] uint8,
               scales [M, L/32] uint8), dequantized in the kernel.
  rhs          MXFP4 MX array (fmt "mxfp4") blocked along L (axis 1 / -2):
               codes [E, L/2, F] uint8 (low nibble = even L index), scales [E, L/32, F].
  group_sizes  [E] int32; rows of lhs are grouped contiguously by expert; sum <= M.
  lhs_quant    a float lhs quantised to MXFP8 in the kernel, per [tm, tc] chunk in VMEM
               (`_fake_quant_fp8`: bitwise the values of ops.mx.quantize), where XLA's
               quantisation before the call made f32 passes over the rows in HBM.
  rhs_up, glu  a gated call: a second weight like rhs and the activation (kind, b1, b2);
               returns glu(lhs @ rhs, lhs @ rhs_up), both products in two accumulators,
               rounded to the output dtype, the activation stored (an expert FFN's hidden).
Any object with `codes`, `scales`, `fmt`, `axis` works as an MX array (k3_jax.ops.mx.MXArray).

Grid and group metadata. The grid is (F tiles, visits, L tiles), F outermost. A "visit"
is one (row tile, group) pair: a row tile of `tm` rows that straddles a group boundary is
visited once per group it holds (the megablox scheme), and each visit stores only the rows
of its group (a row mask from the group offsets), so a straddling tile is completed by
consecutive visits. Visits are listed group by group (so row tiles come in order and an
output tile is only revisited consecutively, which the pipeline needs), then one visit per
row tile past sum(group_sizes) that writes zeros, then padding up to the static bound
tiles_m + E - 1, which repeats the last visit and does nothing. The metadata lives in SMEM
(scalar prefetch) and drives the block index maps.

Weight traffic. The TPU pipeline copies a block only when its block index changes between
consecutive grid steps. With the whole contraction in one tile (tk = L, the default) the
rhs index (group, 0, f) stays put across all visits of one group, so every expert's packed
weights are read from HBM exactly once per call (per F tile, and F tiles partition the
weights); visits that do not compute (zero tails, padding) keep the previous block indices
and so trigger no copies. `rhs_fetches` replays this to count the copies.

Rows outermost (`order="rows_outer"`, or "auto" when it reads fewer bytes: a long
prefill's lhs is many times its local experts' weights, and F outermost reads the lhs once
per F tile, 6-7 times at K3 shapes): the grid is (visits, F tiles, L tiles), each visit's
lhs tile is fetched once for all F tiles, its expert's weights once per visit (so per row
tile, which a larger row tile, ROWS_OUTER_TM, keeps few), every computing step unpacks,
and the output block is the row tile's whole width [tm, F], resident across the visit's F
tiles and the tile's consecutive visits. Its leading grid axis cannot be "parallel" (a
tile's visits are ordered), so a two-core chip runs it on one core.

Unpacking (VPU) runs when a visit starts a new group (flag bit 2) and fills a BF16
[tk, tn] weight tile in VMEM that the following visits of the same group reuse, so it
costs once per (expert, F tile), not once per row tile. It goes in chunks of `tc` rows:
codes -> int32, nibbles -> E2M1 values by building float32 bits (no table), times the
block scale 2^(s-127) (a float32 built from the scale byte), then the low/high nibble
rows are interleaved with two stride-2 sublane stores into a float32 scratch (128-lane
slabs: what Mosaic's strided store supports) and cast to BF16. Every computing visit then
multiplies its lhs tile by the cached weight tile on the MXU, chunk by chunk, into a
float32 accumulator. For an MXFP8 lhs the per-block scale bytes are spread over their 32
columns by a small 0/1 matmul (exact: integers <= 255 and single terms) and the codes are
decoded by building float32 bits the same way. A call of one row tile and one L
tile (a decode's) visits each group once, so nothing reuses an unpacked tile: it unpacks
each chunk and multiplies it at once (`stream`), with no [tk, tn] tile in VMEM.

Numerics: dequantized MXFP4 weights (2 significant bits) and MXFP8 activations (<= 4) times
a power of two are exact in BF16, so the kernel and the reference multiply the same numbers
and differ only in float32 accumulation order. Scale byte 0 (2^-127, subnormal) decodes to
0 here (TPUs flush float32 subnormals); NaN/Inf codes and scale byte 0xFF are not
supported (quantizing finite inputs never produces them).

TPU tiling rules met by the defaults (and checked): row tile tm a multiple of 8 / 16 / 32
for 32- / 16- / 8-bit lhs and output; tn a multiple of 128; tc a multiple of 256 (so the
packed chunk is >= 128 rows and its lhs columns 128-aligned); tk = L, or a multiple of 1024
(its [tk/32, tn] uint8 scale block needs 32-row multiples).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK = 32         # MX block: elements sharing one scale
LANES = 128

# MXFP8 element formats: (exponent bias, mantissa bits).
_FP8 = {"mxfp8_e4m3": (7, 3), "mxfp8_e5m2": (15, 2)}
LHS_FORMATS = tuple(_FP8)
# One BF16 MXU pass, whatever jax_default_matmul_precision says (its "highest" would ask
# Mosaic for an fp32-precision contraction of BF16 operands, which it rejects).
_MXU = (jax.lax.Precision.DEFAULT, jax.lax.Precision.DEFAULT)


class Tiling(NamedTuple):
  """tm rows x tn output columns per output tile; tk contraction per grid step (L or a
  multiple of 1024); tc contraction per in-kernel chunk (multiple of 256 dividing tk)."""
  tm: int
  tn: int
  tk: int
  tc: int


class GroupMetadata(NamedTuple):
  """Per-visit schedule (all int32, in SMEM). V = tiles_m + E - 1 visits."""
  offsets: jax.Array    # [E + 1] first row of each group (clamped to M); offsets[E] = end
  group: jax.Array      # [V] rhs group the visit reads
  tile: jax.Array       # [V] output row tile the visit writes
  lhs_tile: jax.Array   # [V] lhs row tile the visit reads
  flags: jax.Array      # [V] bit 0: computes a group's rows; bit 1: first visit of its
                        # tile; bit 2: its group differs from the previous visit's


def _round_up(x: int, k: int) -> int:
  return -(-x // k) * k


@functools.partial(jax.jit, static_argnames=("m", "tm"))
def group_metadata(group_sizes: jax.Array, m: int, tm: int) -> GroupMetadata:
  """The visit schedule for `m` rows (a multiple of tm) in row tiles of tm.

  Group g owns rows [offsets[g], offsets[g+1]) and is visited on row tiles
  offsets[g] // tm .. ceil(offsets[g+1] / tm) - 1 (none when empty). Visits that do not
  compute keep the previous visit's group and lhs tile, so they cause no copies.
  """
  e = group_sizes.shape[0]
  tiles_m = m // tm
  nv = tiles_m + e - 1
  ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)         # [E]
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])        # [E]
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])            # [E + 1]
  first_tile = starts // tm
  n_tiles = jnp.where(ends > starts, (ends + tm - 1) // tm - first_tile, 0)  # [E]
  cum = jnp.cumsum(n_tiles)
  n_group_visits = cum[-1]
  covered = (ends[-1] + tm - 1) // tm            # row tiles touched by some group
  i = jnp.arange(nv, dtype=jnp.int32)
  g = jnp.minimum(jnp.searchsorted(cum, i, side="right"), e - 1).astype(jnp.int32)
  tile_g = first_tile[g] + i - (cum[g] - n_tiles[g])
  is_group = i < n_group_visits
  is_tail = ~is_group & (i < n_group_visits + tiles_m - covered)
  # Padding repeats the last real visit, whose tile is always tiles_m - 1.
  tile = jnp.where(is_group, tile_g,
                   jnp.where(is_tail, covered + i - n_group_visits, tiles_m - 1))
  last_g = jnp.minimum(jnp.searchsorted(cum, jnp.maximum(n_group_visits - 1, 0),
                                        side="right"), e - 1)
  group = jnp.where(is_group, g, last_g)
  lhs_tile = jnp.where(is_group, tile_g, jnp.maximum(covered - 1, 0))
  prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tile[:-1]])
  prev_group = jnp.concatenate([jnp.full((1,), -1, jnp.int32), group[:-1]])
  flags = (is_group.astype(jnp.int32) | ((tile != prev).astype(jnp.int32) << 1)
           | ((group != prev_group).astype(jnp.int32) << 2))
  i32 = lambda a: a.astype(jnp.int32)
  return GroupMetadata(i32(offsets), i32(group), i32(tile), i32(lhs_tile), i32(flags))


def rhs_fetches(meta: GroupMetadata, tiles_n: int, tiles_k: int) -> np.ndarray:
  """Number of rhs block copies the pipeline issues: steps in grid order (f, visit, k)
  whose rhs block index (group, k, f) differs from the previous step's. Host-side."""
  group = np.asarray(meta.group)
  active = (np.asarray(meta.flags) & 1) == 1
  count, prev = 0, None
  for f in range(tiles_n):
    for v in range(group.shape[0]):
      for k in range(tiles_k):
        idx = (group[v], k if active[v] else tiles_k - 1, f)
        count += idx != prev
        prev = idx
  return np.int64(count)


# ----------------------------------------------------------------------------- decoding


def _bits_to_f32(bits: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _scale_f32(byte: jax.Array) -> jax.Array:
  """E8M0 byte (int32) -> 2^(byte - 127) as float32 (byte 0 -> 0: subnormal flushed)."""
  return _bits_to_f32(byte << 23)


def _e2m1_f32(q: jax.Array) -> jax.Array:
  """E2M1 code (int32 in [0, 16)) -> float32: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.

  Normal codes (exponent field e >= 1): 2^(e-1) (1 + m/2), i.e. float32 exponent field
  e + 126 and mantissa top bit m: bits = (em << 22) + (126 << 23) with em = code & 7.
  Subnormal: em 0 -> 0, em 1 -> 0.5 = 126 << 23.
  """
  em = q & 7
  bits = jnp.where(em < 2, em * (126 << 23), (em << 22) + (126 << 23))
  return _bits_to_f32(bits | ((q & 8) << 28))


def _fp8_f32(c: jax.Array, fmt: str) -> jax.Array:
  """E4M3 / E5M2 code (int32 in [0, 256)) -> float32 (finite codes)."""
  bias, mbits = _FP8[fmt]
  mag = c & 0x7F
  normal = _bits_to_f32((mag << (23 - mbits)) + ((127 - bias) << 23))
  sub = (mag & ((1 << mbits) - 1)).astype(jnp.float32) * np.float32(2.0 ** (1 - bias - mbits))
  val = jnp.where(mag >= (1 << mbits), normal, sub)
  return jnp.where(c >= 128, -val, val)


# ----------------------------------------------------------------------------- kernel


def _block_max(a: jax.Array) -> jax.Array:
  """a [r, c] float32 (c a multiple of 128) -> every lane holds the max of its aligned
  32-lane block: a butterfly over the lane axis, each step taking the lane i ^ d's value
  (d = 1, 2, 4, 8, 16; i ^ d stays in i's block) from one of two lane rotations.

  pltpu.roll follows jnp.roll (out[i] = x[i - shift], its interpret rule), so lane i's
  partner i + d (bit d clear) is the rotation by c - d and i - d (bit d set) the one by d."""
  c = a.shape[1]
  lane = jax.lax.broadcasted_iota(jnp.int32, a.shape, 1)
  for d in (1, 2, 4, 8, 16):
    up = pltpu.roll(a, c - d, 1)                                      # lane i: a[i + d]
    down = pltpu.roll(a, d, 1)                                        # lane i: a[i - d]
    a = jnp.maximum(a, jnp.where((lane & d) == 0, up, down))
  return a


def _exponent(a: jax.Array) -> jax.Array:
  """floor(log2(a)) of a normal float32 a > 0 from its exponent field (int32); 0 and
  float32 subnormals give -127 (callers clamp below: the reference's frexp gives <= -127
  for a subnormal, the same after the clamp)."""
  return ((jax.lax.bitcast_convert_type(a, jnp.int32) >> 23) & 0xFF) - 127


def _fake_quant_fp8(x: jax.Array, fmt: str) -> jax.Array:
  """x [r, c] float32 -> the values `k3_jax.ops.mx.quantize(x, fmt, -1)` dequantizes to
  (blocks of 32 along c), float32, by the same float32 operations as the reference
  (ops/mx.py `_quantize_jit`, `_encode`, `_dequantize_jit`) on each lane:

      s     = clip(floor(log2(block max |x|)) - emax, -127, 127)   (-127 for a zero block)
      v     = x 2^-s;  e = max(floor(log2 |v|), 1 - bias);  q = 2^(e - mbits)
      r     = min(round_half_even(|v| / q) q, max)                   (the element's magnitude)
      value = sign(v) r 2^h 2^(s - h),  h = floor(s / 2)             (the reference's two factors)

  |v| / q is exact as |v| 2^(mbits - e) (a power of two, normal at these exponents). Finite
  inputs only (the reference gives a non-finite block scale byte 0xFF; the kernel does not
  support those, as for a given MXFP8 lhs)."""
  bias, mbits = _FP8[fmt]
  emax, fmax = {"mxfp8_e4m3": (8, 448.0), "mxfp8_e5m2": (15, 57344.0)}[fmt]
  amax = _block_max(jnp.abs(x))
  s = jnp.clip(_exponent(amax) - emax, -127, 127)
  s = jnp.where(amax > 0, s, -127)
  v = x * _pow2(-s)
  a = jnp.abs(v)
  e = jnp.maximum(_exponent(a), 1 - bias)
  r = jnp.minimum(jnp.round(a * _pow2(mbits - e)) * _pow2(e - mbits), np.float32(fmax))
  sign = jax.lax.bitcast_convert_type(v, jnp.int32) & np.int32(-(1 << 31))
  r = _bits_to_f32(jax.lax.bitcast_convert_type(r, jnp.int32) | sign)
  h = s >> 1                                                          # floor(s / 2)
  return r * _pow2(h) * _pow2(s - h)


def _pow2(e: jax.Array) -> jax.Array:
  """2^e as float32 for int32 e in [-126, 127] (exact, from the exponent bits)."""
  return _bits_to_f32((e + 127) << 23)


def _kernel(offsets_ref, group_ref, tile_ref, lhs_tile_ref, flags_ref, layer_ref, *refs,
            lhs_fmt: str | None, tiling: Tiling, tiles_k: int, rows_outer: bool = False,
            lhs_quant: str | None = None, glu: tuple | None = None, stream: bool = False):
  del lhs_tile_ref, layer_ref
  refs = list(refs)
  x_ref = refs.pop(0)
  xs_ref = None if lhs_fmt is None else refs.pop(0)
  wc_ref, ws_ref = refs.pop(0), refs.pop(0)
  wc2_ref, ws2_ref = (refs.pop(0), refs.pop(0)) if glu else (None, None)
  o_ref, acc_ref, wscale_ref, w_ref = refs.pop(0), refs.pop(0), refs.pop(0), refs.pop(0)
  wtile_ref = None if stream else refs.pop(0)
  acc2_ref = refs.pop(0) if glu else None
  wtile2_ref = None if stream or not glu else refs.pop(0)
  wscale2_ref = (refs.pop(0) if stream else wscale_ref) if glu else None
  tm, tn, tk, tc = tiling
  v = pl.program_id(0 if rows_outer else 1)
  n = pl.program_id(1 if rows_outer else 0)
  k = pl.program_id(2)
  flags = flags_ref[v]
  active = (flags & 1) == 1
  first = (flags & 2) == 2
  # The unpacked [tk, tn] weight tile stays in VMEM across the consecutive visits of one
  # group (one L tile: its rhs block does not change), so the VPU unpack runs once per
  # (expert, F tile), not once per row tile; with several L tiles, or rows outermost
  # (each step a new F tile), every computing step unpacks.
  unpack = active & (((flags & 4) == 4) if tiles_k == 1 and not rows_outer else True)

  @pl.when(active & (k == 0))
  def _zero_acc():
    acc_ref[...] = jnp.zeros_like(acc_ref)
    if glu:
      acc2_ref[...] = jnp.zeros_like(acc2_ref)

  def lhs_chunk(c):                                                  # -> [tm, tc] bf16
    l0 = pl.multiple_of(c * tc, tc)
    x = x_ref[:, pl.ds(l0, tc)]
    if lhs_quant is not None:          # MXFP8 values of the float lhs, quantised here
      return _fake_quant_fp8(x.astype(jnp.float32), lhs_quant).astype(jnp.bfloat16)
    if lhs_fmt is None:
      return x.astype(jnp.bfloat16)
    # Spread each block's scale byte over its 32 columns with a 0/1 matmul (exact).
    sb = xs_ref[c].astype(jnp.int32).astype(jnp.float32).astype(jnp.bfloat16)  # [tm, tc/32]
    rows = jax.lax.broadcasted_iota(jnp.int32, (tc // BLOCK, tc), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (tc // BLOCK, tc), 1)
    spread = (cols // BLOCK == rows).astype(jnp.bfloat16)             # [tc/32, tc]
    sfield = jnp.dot(sb, spread, precision=_MXU,
                     preferred_element_type=jnp.float32).astype(jnp.int32)
    vals = _fp8_f32(x.astype(jnp.int32), lhs_fmt) * _scale_f32(sfield)  # [tm, tc]
    return vals.astype(jnp.bfloat16)

  def rhs_chunk(c, wc_ref, wscale_ref=wscale_ref):                   # -> [tc, tn] bf16
    r0 = pl.multiple_of(c * (tc // 2), tc // 2)
    codes = wc_ref[pl.ds(r0, tc // 2), :].astype(jnp.int32)           # [tc/2, tn]
    s0 = pl.multiple_of(c * (tc // BLOCK), tc // BLOCK)
    scale = wscale_ref[pl.ds(s0, tc // BLOCK), :]                     # [tc/32, tn]
    # Packed row j holds L rows 2j (low nibble) and 2j+1 (high): block j // 16.
    scale = jnp.broadcast_to(scale[:, None, :], (tc // BLOCK, BLOCK // 2, tn))
    scale = scale.reshape(tc // 2, tn)                                # [tc/2, tn]
    even = _e2m1_f32(codes & 15) * scale
    odd = _e2m1_f32(codes >> 4) * scale
    for j in range(tn // LANES):                  # interleave rows: even -> 2j, odd -> 2j+1
      cols = slice(j * LANES, (j + 1) * LANES)
      slab = w_ref.at[j]                                              # [tc, 128]
      slab[pl.ds(0, tc // 2, stride=2), :] = even[:, cols]
      slab[pl.ds(1, tc // 2, stride=2), :] = odd[:, cols]
    slabs = [w_ref[j] for j in range(tn // LANES)]                    # tn/128 x [tc, 128]
    w = slabs[0] if len(slabs) == 1 else jnp.concatenate(slabs, axis=1)
    return w.astype(jnp.bfloat16)

  def fill(wc_ref, ws_ref, tile_ref):
    wscale_ref[...] = _scale_f32(ws_ref[...].astype(jnp.int32))       # [tk/32, tn]

    def body(c, carry):
      tile_ref[pl.ds(pl.multiple_of(c * tc, tc), tc), :] = rhs_chunk(c, wc_ref)
      return carry

    jax.lax.fori_loop(0, tk // tc, body, 0)

  def _unpack():
    fill(wc_ref, ws_ref, wtile_ref)
    if glu:                                   # the up projection's tile beside the gate's
      fill(wc2_ref, ws2_ref, wtile2_ref)

  def _stream():
    # One row tile, one L tile: each group has one visit, so nothing would reuse an
    # unpacked [tk, tn] tile: each chunk is unpacked and multiplied at once (the same
    # values and order as from the tile; no tile in VMEM, so wider F tiles fit)
    wscale_ref[...] = _scale_f32(ws_ref[...].astype(jnp.int32))
    if glu:
      wscale2_ref[...] = _scale_f32(ws2_ref[...].astype(jnp.int32))

    def body(c, carry):
      x = lhs_chunk(c)
      acc_ref[...] += jnp.dot(x, rhs_chunk(c, wc_ref), precision=_MXU,
                              preferred_element_type=jnp.float32)
      if glu:
        acc2_ref[...] += jnp.dot(x, rhs_chunk(c, wc2_ref, wscale2_ref), precision=_MXU,
                                 preferred_element_type=jnp.float32)
      return carry

    jax.lax.fori_loop(0, tk // tc, body, 0)

  def _accumulate():
    def body(c, carry):
      rows = pl.ds(pl.multiple_of(c * tc, tc), tc)
      x = lhs_chunk(c)                        # (quantised once for both projections)
      acc_ref[...] += jnp.dot(x, wtile_ref[rows, :], precision=_MXU,
                              preferred_element_type=jnp.float32)
      if glu:
        acc2_ref[...] += jnp.dot(x, wtile2_ref[rows, :], precision=_MXU,
                                 preferred_element_type=jnp.float32)
      return carry

    jax.lax.fori_loop(0, tk // tc, body, 0)

  if stream:
    pl.when(active)(_stream)
  else:
    pl.when(unpack)(_unpack)
    pl.when(active)(_accumulate)

  @pl.when(k == tiles_k - 1)
  def _store():
    g = group_ref[v]
    start, end = offsets_ref[g], offsets_ref[g + 1]
    rows = tile_ref[v] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
    mine = (rows >= start) & (rows < end) & active
    # rows outermost: the output block is the row tile's whole width, resident across its
    # F tiles and consecutive visits; this step stores its F tile's columns
    out = o_ref.at[:, pl.ds(pl.multiple_of(n * tn, tn), tn)] if rows_outer else o_ref
    prev = jnp.where(first, 0.0, out[...].astype(jnp.float32))
    val = acc_ref[...]
    if glu:       # gate and up rounded to the output dtype, as two calls would return them
      val = _glu(val.astype(o_ref.dtype), acc2_ref[...].astype(o_ref.dtype), glu)
      val = val.astype(jnp.float32)
    out[...] = jnp.where(mine, val, prev).astype(o_ref.dtype)


GLU_KINDS = ("situ", "swiglu")


def _glu(gate: jax.Array, up: jax.Array, glu: tuple) -> jax.Array:
  """The gated activation of `k3_jax.ops.activations.glu` (kind, beta1, beta2), by the same
  float32 operations in the same order (this package does not import the model's):
  situ (b1 tanh(g / b1) sigmoid(g)) (b2 tanh(u / b2)), swiglu silu(g) u; gate's dtype."""
  kind, beta1, beta2 = glu
  g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
  if kind == "situ":
    out = (beta1 * jnp.tanh(g / beta1) * jax.nn.sigmoid(g)) * (beta2 * jnp.tanh(u / beta2))
  else:
    out = jax.nn.silu(g) * u
  return out.astype(gate.dtype)


# ----------------------------------------------------------------------------- wrapper


def _is_mx(a: Any) -> bool:
  return all(hasattr(a, name) for name in ("codes", "scales", "fmt", "axis"))


def _row_align(*dtypes) -> int:
  """Sublane multiple a row tile needs for these dtypes: 8 (32-bit), 16 (16-bit), 32 (8-bit)."""
  return max(32 // jnp.dtype(d).itemsize for d in dtypes)


SINGLE_TILE_ROWS = 512    # an aligned m up to this is one row tile (no pad, no slice)
# A call whose rows are one row tile (a decode's expert buffers) splits F in this many
# tiles where they are 128-lane multiples and fit VMEM: F outermost reads the lhs once per
# F tile (6-7 times at 512 lanes), and two keep one tile per core of a two-core chip
# (the parallel grid axis). None: tn 512 as for more rows.
SINGLE_TILE_F_TILES: int | None = 2


def default_tiling(m: int, l: int, f: int, row_align: int = 16, rhs_count: int = 1) -> Tiling:
  """tm 128 (fewer for small m; m itself for an m of up to SINGLE_TILE_ROWS that is a
  multiple of row_align: one row tile, so the call neither pads its lhs to a multiple of
  128 rows nor slices its output back, two copies of each at the node decode's 352-row
  expert buffers), tn 512 (or the largest of 256/128 dividing f), tk = L, tc 512 (256
  when 512 does not divide L). Fits the default scoped VMEM of every TPU generation at K3
  expert shapes (L 3584, F 3072). A call of one row tile takes tn = F / SINGLE_TILE_F_TILES
  where that is a multiple of 128 and the blocks fit _VMEM_BUDGET (BF16 lhs and output:
  k3's decode, 352 rows, F 3072 / 3584, about 42 MB): the lhs read twice a call, not 6-7
  times (its rows are read once per F tile); with two rhs (a gated call, `glu`) F / 4
  where F / 2 does not fit."""
  tm = min(128, _round_up(max(m, 1), row_align))
  if 128 < m <= SINGLE_TILE_ROWS and m % row_align == 0:
    tm = m
  tn = next((t for t in (512, 256, 128) if f % t == 0), f)
  tc = 512 if l % 512 == 0 else 256
  if SINGLE_TILE_F_TILES and tm >= m:
    for tiles in (SINGLE_TILE_F_TILES, 2 * SINGLE_TILE_F_TILES):
      wide = Tiling(tm, f // tiles, l, tc)
      if f % tiles or wide.tn % LANES or wide.tn <= tn:
        break
      if vmem_bytes(wide, 2, 2, False, rhs_count=rhs_count, stream=True) <= _VMEM_BUDGET:
        return wide
  return Tiling(tm, tn, l, tc)


def _check(cond: bool, msg: str) -> None:
  if not cond:
    raise ValueError(msg)


# Grid orders: "f_outer" (F tiles outermost: each expert's weights read once a call, the
# lhs once per F tile) or "rows_outer" (row-tile visits outermost: the lhs read once, each
# visit's weights once per visit), or "auto": the one whose estimated HBM bytes are fewer
# (`choose_order`; a long prefill's rows are many times its local experts' weights).
ORDERS = ("auto", "f_outer", "rows_outer")
ROWS_OUTER_TM = 1024      # rows_outer's default row tile: fewer visits, fewer weight reads
# "auto" takes rows outermost only where it reads at most this share of F-outer's bytes:
# it gives up the parallel grid axis (a two-core chip's second core).
ROWS_OUTER_SHARE = 0.75
_VMEM_BUDGET = 48 << 20


def hbm_bytes(m_pad: int, l: int, f: int, e: int, tiling: Tiling, lhs_row_bytes: float,
              out_itemsize: int, rows_outer: bool, rhs_count: int = 1) -> int:
  """The kernel's HBM bytes as its static estimate counts them (every row of the buffer,
  every visit of the static bound): lhs, packed weights (rhs_count of them), output."""
  tm, tn, tk, _ = tiling
  nv = m_pad // tm + e - 1
  per_expert = rhs_count * (l // 2 + l // BLOCK) * f
  lhs = m_pad * lhs_row_bytes
  if rows_outer:
    return int(lhs + nv * per_expert + m_pad * f * out_itemsize)
  weights = e * per_expert if tk == l else nv * per_expert
  return int((f // tn) * lhs + weights + m_pad * f * out_itemsize)


def choose_order(m: int, l: int, f: int, e: int, row_align: int, lhs_row_bytes: float,
                 out_itemsize: int, rhs_count: int = 1) -> tuple[bool, Tiling]:
  """(rows_outer, tiling) for order "auto" without a given tiling: the default F-outer
  tiling, or rows outermost at ROWS_OUTER_TM rows a tile when that reads fewer bytes."""
  base = default_tiling(m, l, f, row_align, rhs_count)
  tm = min(ROWS_OUTER_TM, _round_up(max(m, 1), row_align))
  wide = base._replace(tm=tm)
  while tm > row_align and vmem_bytes(wide, int(lhs_row_bytes) // l or 1, out_itemsize,
                                      False, f, rhs_count) > _VMEM_BUDGET:
    tm //= 2
    wide = base._replace(tm=tm)
  cost = lambda t, ro: hbm_bytes(_round_up(m, t.tm), l, f, e, t, lhs_row_bytes,
                                 out_itemsize, ro, rhs_count)
  if cost(wide, True) <= ROWS_OUTER_SHARE * cost(base, False):
    return True, wide
  return False, base


def mxfp4_gmm(lhs, rhs, group_sizes: jax.Array, *, preferred_element_type=None,
              tiling: Tiling | tuple[int, int, int, int] | None = None,
              interpret: bool | pltpu.InterpretParams = False,
              layer: jax.Array | None = None, order: str = "auto",
              lhs_quant: str | None = None, rhs_up=None,
              glu: tuple | None = None) -> jax.Array:
  """Grouped matmul lhs [M, L] x MXFP4 rhs [E, L, F] -> [M, F] (see the module docstring).

  layer: with an int32 scalar, rhs is a stack of such weights [layers, E, L, F] (a scanned
  model's) and the call multiplies by rhs[layer]: the kernel's index maps read that layer's
  blocks where they lie, so the stack is not sliced (a Pallas operand must be a whole
  buffer: a slice would be copied out, every expert of the layer, in every layer).

  preferred_element_type: output dtype; default the lhs dtype (BF16 for an MXFP8 lhs).
  tiling: Tiling(tm, tn, tk, tc) or None for `default_tiling`. interpret: run the kernel
  in Pallas interpret mode on CPU (True, or pltpu.InterpretParams for the TPU one).
  order: the grid order (ORDERS); "auto" picks by `choose_order` (with a given tiling,
  by the same byte estimate at that tiling).
  lhs_quant: an MXFP8 format (LHS_FORMATS) to quantise a float lhs to inside the kernel:
  each [tm, tc] chunk's blocks of 32 along L are scaled and rounded in VMEM
  (`_fake_quant_fp8`), so the call multiplies bitwise what it multiplies given
  `ops.mx.quantize(lhs, lhs_quant, -1)`, without that quantisation's passes over the
  buffer in HBM (it reads the lhs in its own dtype instead: 2 bytes a value for BF16
  where MXFP8 is 1 + 1/32). The output dtype defaults to the lhs dtype.
  rhs_up, glu: a gated call: rhs_up a second MXFP4 weight like rhs (the up projection;
  the same layer of its own stack with layer=) and glu = (kind, beta1, beta2), kind one of
  GLU_KINDS; the call returns glu(lhs @ rhs, lhs @ rhs_up), both products rounded to the
  output dtype first, as `k3_jax.ops.activations.glu` of two calls' outputs: each visit
  multiplies its lhs tile (quantised once) by both weight tiles into two accumulators and
  stores the activation, so the gate and up products never reach HBM (nor are read back).
  """
  _check((rhs_up is None) == (glu is None), "rhs_up and glu go together (a gated call)")
  _check(glu is None or (len(glu) == 3 and glu[0] in GLU_KINDS),
         f"glu={glu!r}: expected (kind, beta1, beta2), kind one of {GLU_KINDS}")
  _check(order in ORDERS, f"order={order!r}: expected one of {ORDERS}")
  _check(_is_mx(rhs), f"rhs must be an MXFP4 MX array (codes, scales, fmt, axis), got "
                      f"{type(rhs).__name__}")
  _check(rhs.fmt == "mxfp4", f"rhs.fmt={rhs.fmt!r}; the kernel reads packed 'mxfp4' weights")
  stacked = layer is not None
  _check(rhs.codes.ndim == 3 + stacked and rhs.axis in ((-2,) if stacked else (1, -2)),
         f"rhs must be [E, L, F]{' stacked on a leading layer axis' if stacked else ''} "
         f"blocked along L (axis -2); got codes {rhs.codes.shape}, axis {rhs.axis}")
  codes, scales = rhs.codes, rhs.scales
  if rhs_up is not None:
    _check(_is_mx(rhs_up) and rhs_up.fmt == "mxfp4" and rhs_up.axis == rhs.axis
           and rhs_up.codes.shape == codes.shape and rhs_up.scales.shape == scales.shape,
           "rhs_up must be an MXFP4 MX array shaped and blocked like rhs")
  codes2, scales2 = (None, None) if rhs_up is None else (rhs_up.codes, rhs_up.scales)
  if stacked:
    _check(scales.ndim == 4, f"with layer=, rhs.scales must be [layers, E, L/32, F]; got "
                             f"{scales.shape}")
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
  else:
    codes, scales = codes[None], scales[None]         # one layer (a free reshape)
    if rhs_up is not None:
      codes2, scales2 = codes2[None], scales2[None]
    layer = jnp.zeros((1,), jnp.int32)
  e, l_half, f = codes.shape[1:]
  l = 2 * l_half
  _check(scales.shape[1:] == (e, l // BLOCK, f),
         f"rhs.scales shape {rhs.scales.shape} != (E, L/32, F) = {(e, l // BLOCK, f)}")
  _check(lhs_quant is None or (lhs_quant in _FP8 and not _is_mx(lhs)),
         f"lhs_quant={lhs_quant!r}: expected None or one of {LHS_FORMATS}, with a float lhs")
  if _is_mx(lhs):
    _check(lhs.fmt in _FP8, f"lhs.fmt={lhs.fmt!r}; an MX lhs must be one of {LHS_FORMATS}")
    _check(lhs.codes.ndim == 2 and lhs.axis in (1, -1),
           f"an MX lhs must be [M, L] blocked along L; got codes {lhs.codes.shape}, "
           f"axis {lhs.axis}")
    m = lhs.codes.shape[0]
    _check(lhs.scales.shape == (m, l // BLOCK),
           f"lhs.scales shape {lhs.scales.shape} != (M, L/32) = {(m, l // BLOCK)}")
    lhs_fmt, lhs_dtype = lhs.fmt, jnp.dtype(jnp.uint8)
    default_out = jnp.bfloat16
  else:
    _check(lhs.ndim == 2 and jnp.issubdtype(lhs.dtype, jnp.floating),
           f"lhs must be a float [M, L] array or an MXFP8 MX array; got {lhs.dtype} "
           f"{lhs.shape}")
    m = lhs.shape[0]
    lhs_fmt, lhs_dtype, default_out = None, lhs.dtype, lhs.dtype
  lhs_l = (lhs.codes if lhs_fmt else lhs).shape[1]
  _check(lhs_l == l, f"lhs contraction {lhs_l} != rhs contraction L={l}")
  _check(group_sizes.shape == (e,) and jnp.issubdtype(group_sizes.dtype, jnp.integer),
         f"group_sizes must be an int [E={e}] array; got {group_sizes.dtype} "
         f"{group_sizes.shape}")
  out_dtype = jnp.dtype(preferred_element_type or default_out)
  align = _row_align(lhs_dtype, out_dtype)
  row_bytes = l * jnp.dtype(lhs_dtype).itemsize + (l // BLOCK if lhs_fmt else 0)
  nr = 1 if rhs_up is None else 2
  if tiling is None and order == "auto":
    rows_outer, t = choose_order(m, l, f, e, align, row_bytes, out_dtype.itemsize, nr)
  else:
    t = Tiling(*(tiling or default_tiling(m, l, f, align, nr)))
    rows_outer = order == "rows_outer" or (order == "auto" and hbm_bytes(
        _round_up(m, t.tm), l, f, e, t, row_bytes, out_dtype.itemsize, True, nr)
        <= ROWS_OUTER_SHARE * hbm_bytes(_round_up(m, t.tm), l, f, e, t, row_bytes,
                                        out_dtype.itemsize, False, nr))
  _check(t.tm % align == 0, f"tiling.tm={t.tm} must be a multiple of {align} for lhs "
                            f"{lhs_dtype} / output {out_dtype}")
  _check(f % t.tn == 0 and t.tn % LANES == 0,
         f"tiling.tn={t.tn} must be a multiple of {LANES} dividing F={f}")
  _check(l % t.tk == 0 and (t.tk == l or t.tk % 1024 == 0),
         f"tiling.tk={t.tk} must be L={l} or a multiple of 1024 dividing it")
  _check(t.tc % 256 == 0 and t.tk % t.tc == 0,
         f"tiling.tc={t.tc} must be a multiple of 256 dividing tk={t.tk}")
  return _mxfp4_gmm(lhs.codes if lhs_fmt else lhs, lhs.scales if lhs_fmt else None,
                    codes, scales, group_sizes.astype(jnp.int32), layer,
                    lhs_fmt=lhs_fmt, out_dtype=out_dtype, tiling=t, interpret=interpret,
                    rows_outer=rows_outer, lhs_quant=lhs_quant, wc2=codes2, ws2=scales2,
                    glu=None if glu is None else (glu[0], float(glu[1]), float(glu[2])))


def vmem_bytes(tiling: Tiling, lhs_itemsize: int, out_itemsize: int, mx_lhs: bool,
               out_width: int | None = None, rhs_count: int = 1,
               stream: bool = False) -> int:
  """Rough VMEM need: double-buffered blocks, scratch, and chunk temporaries (out_width:
  the output block's width, tn unless rows are outermost: F; rhs_count: 2 for a gated
  call, each rhs its blocks, accumulator and unpacked tile; stream: no unpacked tile, a
  scale scratch per rhs, as the kernel's one-row-tile calls)."""
  tm, tn, tk, tc = tiling
  blocks = 2 * (tm * tk * lhs_itemsize + rhs_count * (tk // 2 * tn + _round_up(tk // BLOCK, 32)
                                                      * tn) + tm * (out_width or tn) * out_itemsize)
  if mx_lhs:
    blocks += 2 * (tk // tc) * tm * LANES                # [tk/tc, tm, tc/32] lane-padded
  scratch = (rhs_count * (tm * tn * 4 + (0 if stream else tk * tn * 2))
             + (rhs_count if stream else 1) * _round_up(tk // BLOCK, 8) * tn * 4 + tc * tn * 4)
  temps = 6 * (tc // 2) * tn * 4 + 4 * tm * tc * 4       # codes, values, scale, interleaved
  return blocks + scratch + temps


@functools.partial(jax.jit, static_argnames=("lhs_fmt", "out_dtype", "tiling", "interpret",
                                             "rows_outer", "lhs_quant", "glu"))
def _mxfp4_gmm(x, xs, wc, ws, group_sizes, layer, *, lhs_fmt, out_dtype, tiling, interpret,
               rows_outer=False, lhs_quant=None, wc2=None, ws2=None, glu=None):
  tm, tn, tk, tc = tiling
  m, l = x.shape
  e, _, f = wc.shape[1:]                           # wc, ws [layers, E, ...]; layer [1]
  m_pad = _round_up(m, tm)
  if m_pad != m:                                   # padded rows lie past sum(group_sizes)
    x = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    xs = None if xs is None else jnp.pad(xs, ((0, m_pad - m), (0, 0)))
  meta = group_metadata(group_sizes, m_pad, tm)
  tiles_n, tiles_k = f // tn, l // tk
  nv = meta.group.shape[0]

  def kk(k, flags_ref, v):          # non-computing visits keep the last k block (no copy)
    act = flags_ref[v] & 1
    return k * act + (tiles_k - 1) * (1 - act)

  # grid (F tiles, visits, L tiles), or (visits, F tiles, L tiles) with rows outermost
  ids = (lambda a, b: (b, a)) if rows_outer else (lambda a, b: (a, b))

  def lhs_map(a, b, k, offs, grp, tile, lt, flags, lay):
    n, v = ids(a, b)
    return lt[v], kk(k, flags, v)

  def lhs_scale_map(a, b, k, offs, grp, tile, lt, flags, lay):
    n, v = ids(a, b)
    return kk(k, flags, v), lt[v], 0

  def rhs_map(a, b, k, offs, grp, tile, lt, flags, lay):
    n, v = ids(a, b)
    return lay[0], grp[v], kk(k, flags, v), n

  def out_map(a, b, k, offs, grp, tile, lt, flags, lay):
    n, v = ids(a, b)
    return tile[v], 0 if rows_outer else n

  in_specs = [pl.BlockSpec((tm, tk), lhs_map)]
  args = [x]
  if lhs_fmt is not None:
    # [M, L/32] -> [L/tc, M, tc/32]: each chunk's scale bytes as one [tm, tc/32] slab.
    xs = xs.reshape(m_pad, l // tc, tc // BLOCK).transpose(1, 0, 2)
    in_specs.append(pl.BlockSpec((tk // tc, tm, tc // BLOCK), lhs_scale_map))
    args.append(xs)
  nr = 1 if glu is None else 2
  in_specs += [pl.BlockSpec((None, None, tk // 2, tn), rhs_map),
               pl.BlockSpec((None, None, tk // BLOCK, tn), rhs_map)] * nr
  args += [wc, ws] + ([] if glu is None else [wc2, ws2])

  row_bytes = l * x.dtype.itemsize + (0 if xs is None else l // BLOCK)
  # (F outermost: each expert once when tk = L, else every visit; rows outermost: every
  # visit's weights, the lhs once)
  cost = pl.CostEstimate(flops=2 * nr * m_pad * l * f, transcendentals=0,
                         bytes_accessed=hbm_bytes(m_pad, l, f, e, tiling, row_bytes,
                                                  out_dtype.itemsize, rows_outer, nr))
  stream = not rows_outer and tiles_k == 1 and m_pad == tm    # one row tile, one L tile
  need = vmem_bytes(tiling, x.dtype.itemsize, out_dtype.itemsize, lhs_fmt is not None,
                    f if rows_outer else None, nr, stream)
  call = pl.pallas_call(
      functools.partial(_kernel, lhs_fmt=lhs_fmt, tiling=tiling, tiles_k=tiles_k,
                        rows_outer=rows_outer, lhs_quant=lhs_quant, glu=glu,
                        stream=stream),
      out_shape=jax.ShapeDtypeStruct((m_pad, f), out_dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=6,
          grid=(nv, tiles_n, tiles_k) if rows_outer else (tiles_n, nv, tiles_k),
          in_specs=in_specs,
          out_specs=pl.BlockSpec((tm, f if rows_outer else tn), out_map),
          scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32),                 # accumulator
                          pltpu.VMEM((tk // BLOCK, tn), jnp.float32),        # rhs scales
                          pltpu.VMEM((tn // LANES, tc, LANES), jnp.float32)]  # rhs chunk
                         + ([] if stream else [pltpu.VMEM((tk, tn), jnp.bfloat16)])  # tile
                         + ([] if glu is None else [pltpu.VMEM((tm, tn), jnp.float32)]
                            + [pltpu.VMEM((tk // BLOCK, tn), jnp.float32) if stream
                               else pltpu.VMEM((tk, tn), jnp.bfloat16)])),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=(("arbitrary",) * 3 if rows_outer
                               else ("parallel", "arbitrary", "arbitrary")),
          vmem_limit_bytes=int(min(max(2 * need, 32 << 20), 64 << 20))),
      cost_estimate=cost,
      interpret=interpret,
      name="mxfp4_gmm",
  )
  out = call(*meta, layer, *args)
  return out[:m] if m_pad != m else out


__all__ = ["Tiling", "GroupMetadata", "GLU_KINDS", "LHS_FORMATS", "ORDERS", "ROWS_OUTER_TM",
           "ROWS_OUTER_SHARE", "SINGLE_TILE_F_TILES",
           "SINGLE_TILE_ROWS",
           "default_tiling", "group_metadata", "hbm_bytes", "choose_order", "mxfp4_gmm",
           "rhs_fetches", "vmem_bytes"]
