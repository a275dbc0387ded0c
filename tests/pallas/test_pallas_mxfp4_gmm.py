"""MXFP4 grouped-matmul kernel (Pallas, interpret mode on CPU) vs the plain-JAX reference
(dequantize + jax.lax.ragged_dot), its visit schedule, and its TPU compilation.

Tolerance. Dequantized MXFP4 weights and MXFP8 activations are exact in BF16, and a float
lhs is rounded to BF16 by both sides, so kernel and reference sum the same exact float32
products (bf16 x bf16 is exact in float32) and differ only in summation order. For a sum
of L terms any two orders differ by at most 2 (L - 1) 2^-24 sum|terms| (the standard
gamma_(L-1) bound, once per side), so per output element

    |kernel - ref| <= 2 L 2^-24 (|x| @ |w|)                (float32 output)

plus, for a BF16 output, one BF16 rounding of each side: 2^-7 |ref| (one BF16 ulp).
Rows past sum(group_sizes) must be exactly 0.

Default suite: tiny shapes with the smallest legal tiles, one interpret compile per lhs
kind (group sizes are traced, so all patterns reuse it) and one TPU compile (v5e, K3
expert shapes). `-m slow`: wider shapes, several L tiles, E5M2, all three TPU generations.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from k3_jax.ops import mx
from k3_jax.ops.moe import ragged_dot_gmm
from k3_jax.ops.mx_gmm import mxfp4_gmm as reference
from k3_jax.ops.mx_gmm import packed_gmm
from pallas_kernels.mxfp4_gmm import (Tiling, group_metadata, mxfp4_gmm,
                                      rhs_fetches)

M, L, F, E = 64, 256, 256, 4

# Group-size patterns over E=4 experts and M=64 rows: ragged with an empty expert and
# rows past the end, all empty, one expert holding everything, tile-aligned, empties
# around a single straddling group, groups smaller than a tile.
PATTERNS = [
    [5, 0, 30, 20],
    [0, 0, 0, 0],
    [64, 0, 0, 0],
    [16, 16, 16, 16],
    [0, 3, 0, 58],
    [1, 2, 3, 4],
]


def _data(seed, m=M, l=L, f=F, e=E):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(m, l)).astype(np.float32)
  # Weights with per-block magnitudes spread over 2^-6..2^2, so scales differ per block.
  w = rng.normal(size=(e, l, f)) * 2.0 ** rng.integers(-6, 3, size=(e, l // 32, 1, f)
                                                       ).repeat(32, axis=1).reshape(e, l, f)
  return jnp.asarray(x), mx.quantize(jnp.asarray(w, jnp.float32), "mxfp4", axis=1)


def _abs_bound(x, w_mx, sizes):
  """|x| @ |w| per output element (float32), for the summation-order bound."""
  xa = jnp.abs(mx.dequantize(x, jnp.float32) if isinstance(x, mx.MXArray)
               else x.astype(jnp.bfloat16).astype(jnp.float32))
  wa = jnp.abs(mx.dequantize(w_mx, jnp.float32))
  return np.asarray(jax.lax.ragged_dot(xa, wa, sizes, preferred_element_type=jnp.float32))


def _assert_close(out, ref, bound, sizes, l, bf16_out):
  total = int(np.sum(np.asarray(sizes)))
  o = np.asarray(out.astype(jnp.float32))
  r = np.asarray(ref.astype(jnp.float32))
  assert np.all(o[total:] == 0), "rows past sum(group_sizes) must be exactly zero"
  tol = 2 * l * 2.0 ** -24 * bound + (2.0 ** -7 * np.abs(r) if bf16_out else 0.0)
  err = np.abs(o - r)
  assert np.all(err <= tol), f"max excess {np.max(err - tol)} (max err {err.max()})"


@pytest.fixture(scope="module")
def data():
  return _data(0)


@pytest.mark.parametrize("kind", ["bf16_to_f32", "bf16_to_bf16", "f32_to_f32", "mxfp8_to_f32"])
def test_kernel_matches_reference(data, kind):
  """All PATTERNS per lhs/output kind. bf16_to_bf16 uses M = 56 rows with tm = 16, so the
  wrapper pads the rows to 64 (padding lies past sum(group_sizes)) and slices it off.
  bf16_to_f32 runs in the TPU interpret mode with VMEM/HBM buffers initialised to NaN, so
  reading anything the kernel did not write (output rows, the cached weight tile) shows."""
  x, w = data
  m = M
  interpret, patterns = True, PATTERNS
  if kind == "bf16_to_f32":                          # slower mode: the three hardest patterns
    interpret = pltpu.InterpretParams(uninitialized_memory="nan")
    patterns = [PATTERNS[0], PATTERNS[1], PATTERNS[4]]
  if kind == "mxfp8_to_f32":
    lhs, out_dtype = mx.quantize(x, "mxfp8_e4m3", axis=-1), jnp.float32
    tiling = Tiling(32, 128, L, 256)
  elif kind == "f32_to_f32":
    lhs, out_dtype, tiling = x, None, Tiling(8, 128, L, 256)
  else:
    out_dtype = jnp.float32 if kind.endswith("f32") else None
    m = M if kind.endswith("f32") else 56
    lhs, tiling = x[:m].astype(jnp.bfloat16), Tiling(16, 128, L, 256)
  for pattern in patterns:
    # Clip the pattern's cumulative ends to m so that sum(group_sizes) <= m.
    sizes = jnp.asarray(np.diff(np.minimum(np.cumsum([0] + pattern), m)), jnp.int32)
    out = mxfp4_gmm(lhs, w, sizes, preferred_element_type=out_dtype, tiling=tiling,
                    interpret=interpret)
    ref = reference(lhs, w, sizes, preferred_element_type=out_dtype)
    assert out.shape == ref.shape == (m, F) and out.dtype == ref.dtype, (out.dtype, ref.dtype)
    _assert_close(out, ref, _abs_bound(lhs, w, sizes), sizes, L,
                  bf16_out=out.dtype == jnp.bfloat16)
    if kind == "mxfp8_to_f32":
      # Drop-in for the serving path: k3_jax.ops.mx_gmm.packed_gmm (MXFP8 fake-quantized float32
      # activations, dequantized weights, ragged_dot) computes the same numbers.
      serving = packed_gmm(ragged_dot_gmm)(x, w, sizes)
      _assert_close(out, serving, _abs_bound(lhs, w, sizes), sizes, L, bf16_out=False)


def _replay(meta, m, tm, sizes):
  """Which (row -> group) each computing visit stores, with the pipeline's rules."""
  offsets = np.asarray(meta.offsets)
  group, tile, lhs_tile = (np.asarray(a) for a in (meta.group, meta.tile, meta.lhs_tile))
  flags = np.asarray(meta.flags)
  owner = np.full(m, -2)                       # -2 never written, -1 zeroed, g stored
  unpacked = -1                                # group whose weight tile is in VMEM
  for v in range(group.shape[0]):
    if flags[v] & 4:
      assert v == 0 or group[v] != group[v - 1]
      unpacked = group[v] if flags[v] & 1 else unpacked
    active, first = flags[v] & 1, flags[v] & 2
    if v > 0:                                  # output tiles only revisited consecutively
      assert tile[v] >= tile[v - 1]
      assert bool(first) == (tile[v] != tile[v - 1])
    rows = np.arange(tile[v] * tm, (tile[v] + 1) * tm)
    if first:
      owner[rows] = -1
    if active:
      assert lhs_tile[v] == tile[v]
      g = group[v]
      assert unpacked == g, "a computing visit must find its group's weights unpacked"
      mine = (rows >= offsets[g]) & (rows < offsets[g + 1])
      assert mine.any(), "a computing visit must hold rows of its group"
      owner[rows[mine]] = g
  expected = np.full(m, -1)
  ends = np.cumsum(sizes)
  for g, (s, e) in enumerate(zip(ends - sizes, ends)):
    expected[s:e] = g
  return owner, expected


@pytest.mark.parametrize("sizes", PATTERNS + [[0, 0, 0, 64], [13, 0, 0, 0], [0, 0, 33, 0]])
def test_visit_schedule(sizes):
  """Every row is stored by exactly its own group, the rest zeroed; with one L tile the
  rhs of each non-empty expert is copied once per F tile and idle visits copy nothing."""
  tm = 16
  meta = group_metadata(jnp.asarray(sizes, jnp.int32), M, tm)
  assert meta.group.shape == (M // tm + E - 1,)
  owner, expected = _replay(meta, M, tm, np.asarray(sizes))
  np.testing.assert_array_equal(owner, expected)
  nonempty = int(np.count_nonzero(sizes))
  # All empty: the idle visits still hold one (unused) rhs block per F tile.
  assert rhs_fetches(meta, tiles_n=3, tiles_k=1) == 3 * max(1, nonempty)
  # Several L tiles: each computing visit walks them all, so copies grow with visits.
  assert rhs_fetches(meta, tiles_n=1, tiles_k=2) >= 2 * nonempty


def test_bad_inputs(data):
  x, w = data
  sizes = jnp.zeros((E,), jnp.int32)
  with pytest.raises(ValueError, match="mxfp4"):
    mxfp4_gmm(x, mx.quantize(jnp.ones((E, L, F)), "mxfp8_e4m3", axis=1), sizes)
  with pytest.raises(ValueError, match="mxfp8"):
    mxfp4_gmm(mx.quantize(x, "mxfp4", axis=-1), w, sizes)
  with pytest.raises(ValueError, match="contraction"):
    mxfp4_gmm(x[:, :128], w, sizes)
  with pytest.raises(ValueError, match="tm=8"):
    mxfp4_gmm(x.astype(jnp.bfloat16), w, sizes, tiling=Tiling(8, 128, L, 256))
  with pytest.raises(ValueError, match="tn=96"):
    mxfp4_gmm(x, w, sizes, tiling=Tiling(8, 96, L, 256))
  with pytest.raises(ValueError, match="group_sizes"):
    mxfp4_gmm(x, w, jnp.zeros((E + 1,), jnp.int32))


# ----------------------------------------------------------------------------- slow


@pytest.mark.slow
@pytest.mark.parametrize("lhs_fmt", [None, "mxfp8_e4m3", "mxfp8_e5m2"])
def test_kernel_wide_several_l_tiles(lhs_fmt):
  """L = 2048 in two 1024-row L tiles of two 512-row chunks, tn = 256 (two 128-lane
  slabs), E = 8 with random ragged sizes (some empty) and rows past the end."""
  m, l, f, e = 256, 2048, 512, 8
  x, w = _data(1, m, l, f, e)
  lhs = x.astype(jnp.bfloat16) if lhs_fmt is None else mx.quantize(x, lhs_fmt, axis=-1)
  rng = np.random.default_rng(2)
  for _ in range(3):
    share = rng.gamma(1.0, size=e) * (rng.random(e) > 0.3)
    sizes = np.floor(share / max(share.sum(), 1e-9) * rng.integers(m // 2, m + 1)).astype(
        np.int32)
    sizes = jnp.asarray(sizes)
    out = mxfp4_gmm(lhs, w, sizes, preferred_element_type=jnp.float32,
                    tiling=Tiling(32, 256, 1024, 512), interpret=True)
    ref = reference(lhs, w, sizes, preferred_element_type=jnp.float32)
    _assert_close(out, ref, _abs_bound(lhs, w, sizes), sizes, l, bf16_out=False)


def _compile(gen, kind, **kw):
  from benchmarks.mxfp4_gmm import compile_gmm
  return compile_gmm(gen, kind, **kw)


@pytest.mark.parametrize("gen", ["v5e", "v5p", "v6e"])
def test_compiles_for_tpu(gen):
  """Lowers through Mosaic and compiles inside shard_map for a 4-chip slice at K3 expert
  shapes (L 3584, F 3072, 14 local experts, 4096 rows per chip); the arguments per chip
  are the packed weights (4.25 bits each) plus the BF16 lhs, nothing unpacked."""
  compiled = _compile(gen, "mxfp4")
  assert "tpu_custom_call" in compiled.as_text()
  packed = 14 * (3584 // 2 + 3584 // 32) * 3072
  args = compiled.memory_analysis().argument_size_in_bytes
  assert 0 <= args - (packed + 4096 * 3584 * 2) <= 4096     # + group_sizes, padded


@pytest.mark.slow
@pytest.mark.parametrize("gen", ["v5e", "v5p", "v6e"])
def test_compiles_for_tpu_mxfp8_lhs(gen):
  compiled = _compile(gen, "mxfp4+fp8")
  assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.slow
def test_compiles_for_tpu_lhs_quantised_in_kernel():
  """lhs_quant (the node decode's expert calls): Mosaic lowers the in-kernel MXFP8
  quantisation (lane rotations, round-half-even, bit casts) and the one-row-tile default
  tiling (tn = F / 2) fits VMEM, at k3 v5p-128 1,024 x 32K's 352-row buffers, both
  projections' shapes; and the gated call (two weight tiles, the SiTU activation; tn =
  F / 4) at the gate / up shape (v5p)."""
  for kind, l, f in (("mxfp4+q8", 3584, 3072), ("mxfp4+q8", 3072, 3584),
                     ("mxfp4+q8+glu", 3584, 3072)):
    compiled = _compile("v5p", kind, rows=352, e=14, l=l, f=f)
    assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.slow
@pytest.mark.parametrize("lhs_kind", ["mxfp4", "mxfp4+fp8"])
def test_compiles_several_l_tiles(lhs_kind):
  """tk < L: [32, tn] uint8 scale blocks, L = 2048 in two 1024 tiles (v6e)."""
  compiled = _compile("v6e", lhs_kind, rows=512, e=8, l=2048, f=1024,
                      tiling=Tiling(128, 256, 1024, 512))
  assert "tpu_custom_call" in compiled.as_text()


def test_stacked_rhs_reads_its_layer(data):
  """layer=: a [layers, E, L, F] stack multiplied at one layer gives bitwise what the
  layer's own [E, L, F] slice gives (the same blocks, read through the index map)."""
  x, w = data
  stack = mx.MXArray(jnp.stack([w.codes[::-1], w.codes, w.codes[::-1]]),
                     jnp.stack([w.scales[::-1], w.scales, w.scales[::-1]]), "mxfp4", -2)
  sizes = jnp.asarray(PATTERNS[0], jnp.int32)
  lhs = x.astype(jnp.bfloat16)
  want = mxfp4_gmm(lhs, w, sizes, tiling=Tiling(16, 128, 256, 256), interpret=True)
  got = mxfp4_gmm(lhs, stack, sizes, tiling=Tiling(16, 128, 256, 256), interpret=True,
                  layer=jnp.int32(1))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_scanned_layers_pass_the_stack_to_the_kernel():
  """Under a layer scan, packed weights given as mx_gmm.StackedLayer reach the TPU kernel
  as the whole stack (v5p compile): no per-layer copy of the experts out of the stack."""
  from benchmarks.mxfp4_gmm import AXIS as X, _mesh
  from jax.sharding import NamedSharding, PartitionSpec as P
  from k3_jax.ops.mx_gmm import StackedLayer
  layers, e, l, f, m = 3, 4, 256, 256, 64
  mesh = _mesh("v5p")
  gmm = packed_gmm(ragged_dot_gmm, kernel=True)

  def local(x, wc, ws, g):
    def body(h, i):
      return gmm(h, StackedLayer(mx.MXArray(wc, ws, "mxfp4", -2), i), g).astype(h.dtype), None
    return jax.lax.scan(body, x, jnp.arange(layers))[0]

  fn = jax.shard_map(local, mesh=mesh, in_specs=(P(X), P(None, X), P(None, X), P(X)),
                     out_specs=P(X), check_vma=False)
  n = mesh.devices.size
  sds = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
  text = jax.jit(fn).lower(sds((n * m, l), jnp.bfloat16, P(X)),
                           sds((layers, n * e, l // 2, f), jnp.uint8, P(None, X)),
                           sds((layers, n * e, l // 32, f), jnp.uint8, P(None, X)),
                           sds((n * e,), jnp.int32, P(X))).compile().as_text()
  calls = [ln for ln in text.splitlines() if 'custom_call_target="tpu_custom_call"' in ln
           and "mxfp4_gmm" in ln]
  assert calls and all(f"u8[{layers},{e},{l // 2},{f}]" in ln for ln in calls)


def test_rows_outer_order_matches_reference(data):
  """order="rows_outer": visits outermost, the output block the row tile's whole width;
  in the TPU interpret mode with memory initialised to NaN (an output column or weight
  tile it failed to write shows), ragged groups that straddle row tiles, empty groups and
  rows past the end; equal to the F-outer order bitwise (the same products and sums)."""
  x, w = data
  lhs = x.astype(jnp.bfloat16)
  interpret = pltpu.InterpretParams(uninitialized_memory="nan")
  for pattern in (PATTERNS[0], PATTERNS[4]):
    sizes = jnp.asarray(np.diff(np.minimum(np.cumsum([0] + pattern), M)), jnp.int32)
    got = mxfp4_gmm(lhs, w, sizes, preferred_element_type=jnp.float32,
                    tiling=Tiling(16, 128, L, 256), interpret=interpret, order="rows_outer")
    ref = reference(lhs, w, sizes, preferred_element_type=jnp.float32)
    _assert_close(got, ref, _abs_bound(lhs, w, sizes), sizes, L, bf16_out=False)
    f_outer = mxfp4_gmm(lhs, w, sizes, preferred_element_type=jnp.float32,
                        tiling=Tiling(16, 128, L, 256), interpret=True, order="f_outer")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(f_outer))


def test_order_choice_by_bytes():
  """auto: F outermost for a small decode's few rows (each expert's weights once), rows
  outermost for a long prefill's many (the lhs once instead of once per F tile)."""
  from pallas_kernels.mxfp4_gmm import ROWS_OUTER_TM, choose_order, default_tiling, hbm_bytes
  l, f, e = 3584, 3072, 14
  ro, t = choose_order(112, l, f, e, 32, l + l // 32, 2)      # 8 tokens x 14 local experts
  assert not ro and t.tm == 128
  ro, t = choose_order(1 << 19, l, f, e, 32, l + l // 32, 2)
  assert ro and t.tm == ROWS_OUTER_TM
  f_out = hbm_bytes(1 << 19, l, f, e, default_tiling(1 << 19, l, f, 32), l + l // 32, 2, False)
  assert hbm_bytes(1 << 19, l, f, e, t, l + l // 32, 2, True) < 0.6 * f_out
  with pytest.raises(ValueError, match="order"):
    mxfp4_gmm(jnp.zeros((16, L), jnp.bfloat16), _data(0)[1], jnp.zeros((E,), jnp.int32),
              order="columns")


def test_default_tiling_takes_an_aligned_buffer_in_one_row_tile():
  """default_tiling: an m of 129 to SINGLE_TILE_ROWS rows that is a multiple of the lhs'
  row alignment is one row tile (the node decode's 352-row expert buffers: no pad to 384
  rows, no slice of the output back); otherwise tiles of 128. The one-tile call (160
  MXFP8 rows, groups straddling nothing but the tile) matches the reference."""
  from pallas_kernels.mxfp4_gmm import SINGLE_TILE_ROWS, default_tiling
  assert default_tiling(352, 3584, 3072, 32).tm == 352
  assert default_tiling(336, 3584, 3072, 32).tm == 128            # not a multiple of 32
  assert default_tiling(SINGLE_TILE_ROWS + 32, 3584, 3072, 32).tm == 128
  assert default_tiling(64, 3584, 3072, 32).tm == 64
  # one row tile: F in SINGLE_TILE_F_TILES = 2 tiles (the lhs read twice, not 6-7 times)
  assert default_tiling(352, 3584, 3072, 16).tn == 1536
  assert default_tiling(352, 3072, 3584, 16).tn == 1792
  assert default_tiling(1024, 3584, 3072, 16).tn == 512           # several row tiles
  x, w = _data(5, m=160, l=L, f=128)
  lhs = mx.quantize(x, "mxfp8_e4m3", axis=-1)
  sizes = jnp.asarray([50, 0, 70, 31], jnp.int32)
  out = mxfp4_gmm(lhs, w, sizes, preferred_element_type=jnp.float32,
                  tiling=default_tiling(160, L, 128, 32), interpret=True)
  ref = reference(lhs, w, sizes, preferred_element_type=jnp.float32)
  _assert_close(out, ref, _abs_bound(lhs, w, sizes), sizes, L, bf16_out=False)


def test_lhs_quantised_in_the_kernel_is_bitwise_the_mxfp8_lhs(data):
  """lhs_quant: a float lhs quantised to MXFP8 inside the kernel (each chunk's blocks of
  32 scaled and rounded in VMEM, `_fake_quant_fp8`) multiplies exactly the values
  `mx.quantize(lhs, fmt, -1)` dequantizes to, so the call equals the one given that MXFP8
  lhs bitwise (same products, same summation order): BF16 rows whose blocks span 2^-20 to
  2^20 (scales differ per block), an all-zero block, blocks that saturate (|x| / 2^s in
  [448, 512)), E4M3 subnormals and halfway ties, -0; ragged groups straddling row tiles
  and rows past the end (exactly 0). The in-kernel quantisation is also checked alone
  against the reference (E4M3 from BF16, E5M2 from float32)."""
  from pallas_kernels.mxfp4_gmm import _fake_quant_fp8
  x, w = data
  rng = np.random.default_rng(3)
  v = np.asarray(x) * 2.0 ** rng.integers(-20, 21, size=(M, L // 32, 1)).repeat(32, 1
                                                                             ).reshape(M, L)
  v[0, :32] = 0.0
  v[1, :32], v[1, 0] = 1.0, 1.93                      # 1.93 / 2^-8 = 494: saturates to 448
  v[2, :] = rng.integers(-40, 41, size=L) * 2.0 ** -10  # E4M3 subnormals, ties to even
  v[3, 64:96], v[3, 64] = 17.0 * 2.0 ** -5, 496.0     # ties: 8.5 -> 8, 15.5 -> 16 (> 448)
  v[4, 5] = -0.0
  for fmt, dt in (("mxfp8_e4m3", jnp.bfloat16), ("mxfp8_e5m2", jnp.float32)):
    a = jnp.asarray(v, dt)
    want = mx.dequantize(mx.quantize(a, fmt, -1), jnp.float32)
    got = jax.jit(lambda b: _fake_quant_fp8(b.astype(jnp.float32), fmt))(a)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  lhs = jnp.asarray(v, jnp.bfloat16)
  w = mx.MXArray(w.codes[..., :128], w.scales[..., :128], "mxfp4", -2)   # one F tile
  sizes = jnp.asarray([5, 0, 30, 20], jnp.int32)
  kw = dict(preferred_element_type=jnp.float32, tiling=Tiling(32, 128, L, 256),
            interpret=True)
  got = mxfp4_gmm(lhs, w, sizes, lhs_quant="mxfp8_e4m3", **kw)
  want = mxfp4_gmm(mx.quantize(lhs, "mxfp8_e4m3", -1), w, sizes, **kw)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert np.all(np.asarray(got)[55:] == 0)
  with pytest.raises(ValueError, match="lhs_quant"):
    mxfp4_gmm(mx.quantize(lhs, "mxfp8_e4m3", -1), w, sizes, lhs_quant="mxfp8_e4m3")


@pytest.mark.slow
def test_gated_call_is_bitwise_the_two_calls_and_activation(data):
  """rhs_up + glu (the expert FFN's gate and up projections in one call, ops/mx_gmm.packed_gmm
  `gated`): glu(gate, up) of the two calls' outputs (each rounded to BF16, the activation of
  k3_jax.ops.activations), bitwise in interpret mode for SiTU (the kernel computes the
  activation by the same float32 operations; on TPU Mosaic's tanh / logistic may differ
  from XLA's in the last bit, within one BF16 rounding of the output); a row tile of all 64
  rows (the decode's one-tile call), ragged groups, rows past the end 0."""
  from k3_jax.ops.activations import glu
  x, w = data
  up = _data(1)[1]
  one_tile = lambda a: mx.MXArray(a.codes[..., :128], a.scales[..., :128], "mxfp4", -2)
  w, up = one_tile(w), one_tile(up)
  lhs = x.astype(jnp.bfloat16)
  sizes = jnp.asarray([5, 0, 30, 20], jnp.int32)
  kw = dict(tiling=Tiling(64, 128, L, 256), interpret=True, lhs_quant="mxfp8_e4m3")
  got = mxfp4_gmm(lhs, w, sizes, rhs_up=up, glu=("situ", 4.0, 25.0), **kw)
  want = glu(mxfp4_gmm(lhs, w, sizes, **kw), mxfp4_gmm(lhs, up, sizes, **kw), "situ",
             beta1=4.0, beta2=25.0)
  assert got.dtype == want.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                np.asarray(want.astype(jnp.float32)))
  assert np.all(np.asarray(got.astype(jnp.float32))[55:] == 0)
  with pytest.raises(ValueError, match="rhs_up and glu"):
    mxfp4_gmm(lhs, w, sizes, rhs_up=up, **kw)
