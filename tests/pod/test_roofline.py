"""The HLO roofline (pod/roofline.py) against exact counts of small programs compiled for
TPU topologies (compile-only devices): FLOPs of a scanned program are the analytic count
(XLA's own cost analysis counts a loop body once), an unrolled program agrees with XLA's cost
analysis, and the cross-slice part of a multi-slice program is found as DCN traffic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pod import roofline as rl
from pod.topology import topology_devices

D, ROWS = 512, 64


def _grad_program(mesh, layers, unroll, x_spec, w_spec=P(None, "fsdp", None)):
  def loss(w, x):
    def body(c, w1):
      return jnp.tanh(c @ w1), None
    c, _ = jax.lax.scan(body, x, w, unroll=unroll)
    return jnp.sum(c.astype(jnp.float32) ** 2)
  fn = jax.jit(jax.grad(loss), in_shardings=(NamedSharding(mesh, w_spec),
                                             NamedSharding(mesh, x_spec)),
               out_shardings=NamedSharding(mesh, w_spec))
  return fn.lower(jax.ShapeDtypeStruct((layers, D, D), jnp.bfloat16),
                  jax.ShapeDtypeStruct((ROWS, D), jnp.bfloat16)).compile()


@pytest.fixture(scope="module")
def one_slice():
  return Mesh(np.array(topology_devices("v5p:2x2x1")).reshape(4), ("fsdp",))


def test_scanned_layers_count_every_iteration(one_slice):
  rows = ROWS // 4                                   # the batch is split over the 4 chips
  per_matmul = 2 * rows * D * D
  for layers in (3, 6):
    c = _grad_program(one_slice, layers, 1, P("fsdp", None))
    costs = rl.program_costs(c.as_text())
    # forward, weight gradient and input gradient of every layer (a scan computes the first
    # layer's input gradient too): 3 matmuls a layer, per chip.
    assert costs.flops == 3 * layers * per_matmul
    assert costs.unknown_trip_loops == 0
    # each layer gathers its weight shards (forward and backward) and reduces its gradient
    assert costs.collectives["all-gather"]["count"] == 2 * layers
    weight = D * D * 2
    assert costs.collectives["all-gather"]["bytes"] == 2 * layers * weight
    assert costs.collectives["all-gather"]["wire_bytes"] == 2 * layers * weight * 3 / 4
  # XLA's cost analysis sees one iteration: the gap this module exists to close
  assert c.cost_analysis()["flops"] < costs.flops / 3


def test_unrolled_program_agrees_with_xla_cost_analysis(one_slice):
  c = _grad_program(one_slice, 3, True, P("fsdp", None))
  text, xla = c.as_text(), c.cost_analysis()
  costs = rl.program_costs(text, hbm_only=False)
  # XLA also counts elementwise FLOPs (tanh's derivative, the square): within 5%
  assert costs.flops == pytest.approx(xla["flops"], rel=0.05)
  # XLA's bytes count every buffer, wherever the compiler placed it
  assert costs.hbm_bytes == pytest.approx(xla["bytes accessed"], rel=0.10)
  # the HBM count leaves out what memory-space assignment keeps on chip (S(1): VMEM)
  hbm = rl.program_costs(text).hbm_bytes
  assert "S(1)" in text and 0 < hbm < costs.hbm_bytes


def test_multi_slice_traffic_is_dcn_and_only_the_gradient_reduction():
  devs = topology_devices("v5p:2x2x1", 2)
  mesh = Mesh(np.array(devs).reshape(2, 4), ("data", "fsdp"))
  c = _grad_program(mesh, 3, 1, P(("data", "fsdp"), None))
  r = rl.roofline(rl.program_costs(c.as_text()), "v5p")
  assert r["dcn_bytes_per_chip"] > 0
  assert set(r["dcn_by_collective"]) == {"all-reduce"}     # the data-parallel gradient sum
  assert r["bound"] in ("compute", "hbm", "ici", "dcn")
  assert r["step_time_s"] == max(r["seconds"].values())
  assert r["seconds"]["dcn"] == pytest.approx(r["dcn_bytes_per_chip"]
                                              / rl.CHIPS["v5p"]["dcn_bytes_s"])
  one = rl.roofline(rl.program_costs(_grad_program(
      Mesh(np.array(devs[:4]).reshape(4), ("fsdp",)), 3, 1, P("fsdp", None)).as_text()), "v5p")
  assert one["dcn_bytes_per_chip"] == 0
  assert "DCN" in rl.format_roofline(r)


def test_type_bytes_and_group_sizes():
  assert rl.type_bytes("bf16[8,512]{1,0:T(8,128)(2,1)}") == 8 * 512 * 2
  assert rl.type_bytes("(s32[], f32[4,4]{1,0}, /*index=2*/u8[3])") == 4 + 64 + 3
  assert rl.type_bytes("f4e2m1fn[32,2]") == 32
  assert rl._group_size("replica_groups={{0,1,2,3},{4,5,6,7}}, dims") == 4
  assert rl._group_size("replica_groups=[4,2]<=[8]") == 2
  assert rl._group_size("replica_groups=mesh['a'=4,'b'=2,'c'=3] {'a','c'}, x") == 12


def test_batched_matmuls_written_as_convolutions_count_real_taps_only(one_slice):
  # The TPU compiler writes per-head matmuls as convolutions whose head axis is a spatial
  # window (padded, or over a dilated input); only taps on real elements are FLOPs. Each
  # einsum here compiles to one such form (checked: the window attribute).
  rep = NamedSharding(one_slice, P())
  for eq, xs, ws, window in (("td,dhk->thk", (1024, 192), (192, 3, 96), "pad=2_2"),
                             ("bhd,hde->bhe", (64, 3, 64), (3, 64, 48), "lhs_dilate=3"),
                             ("thk,hkd->td", (1024, 3, 64), (3, 64, 192), "size=3")):
    fn = jax.jit(lambda x, w, eq=eq: jnp.einsum(eq, x, w), in_shardings=(rep, rep))
    text = fn.lower(jax.ShapeDtypeStruct(xs, jnp.bfloat16),
                    jax.ShapeDtypeStruct(ws, jnp.bfloat16)).compile().as_text()
    assert window in text
    dims = dict(zip(eq.split("->")[0].replace(",", ""), xs + ws))
    assert rl.program_costs(text).flops == 2 * np.prod(list(dims.values()), dtype=np.int64)
  assert rl._conv_flops((8, 4), (4, 5), (8, 5), "dim_labels=bf_io->bf") == 2 * 8 * 4 * 5


def test_a_slice_of_relaid_stacked_weights_reads_the_slice():
  """A loop fusion that relays out a stacked operand (a nested copy fusion) and slices one
  layer of it reads that layer: a scanned unit's per-layer weights, not the whole stack."""
  from pod.roofline import program_costs
  hlo = """HloModule m, entry_computation_layout={(u8[22,4,8]{2,1,0}, s32[])->u8[4,8]{1,0}}

%copy_fusion (p: u8[22,4,8]) -> u8[22,4,8] {
  %p = u8[22,4,8]{2,1,0} parameter(0)
  ROOT %c = u8[22,4,8]{1,2,0} copy(%p)
}

%fused (param_0: u8[22,4,8], param_1: s32[]) -> u8[4,8] {
  %param_0 = u8[22,4,8]{2,1,0} parameter(0)
  %relaid = u8[22,4,8]{1,2,0} fusion(%param_0), kind=kLoop, calls=%copy_fusion
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = u8[1,4,8]{2,1,0} dynamic-slice(%relaid, %param_1, %zero, %zero), dynamic_slice_sizes={1,4,8}
  ROOT %b = u8[4,8]{1,0} bitcast(%ds)
}

ENTRY %main (w: u8[22,4,8], i: s32[]) -> u8[4,8] {
  %w = u8[22,4,8]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %f = u8[4,8]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused
}
"""
  # reads the 32-byte slice and the 4-byte index, writes 32 bytes (not 704 + 4 + 32)
  assert program_costs(hlo).hbm_bytes == 32 + 4 + 32


def test_pallas_calls_add_their_cost_estimates():
  """A Pallas custom call counts the FLOPs and HBM bytes of the cost estimate in its
  backend config (by kernel name), in place of its boundary bytes, times its loop's trip
  count; one without an estimate stays under not_counted with its boundary bytes."""
  from pod.roofline import program_costs, roofline
  est = ('backend_config={"custom_call_config":{"body":"AAAA","cost_estimate":{"flops":'
         '"1000","transcendentals":"0","bytes_accessed":"500","remote_bytes_transferred":"0"}}}')
  hlo = f"""HloModule m, entry_computation_layout={{(f32[64]{{0}})->f32[64]{{0}}}}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {{
  %p = (s32[], f32[64]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64]{{0}} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  %_mxfp4_gmm.3 = f32[64]{{0}} custom-call(%x), custom_call_target="tpu_custom_call", {est}
  ROOT %t = (s32[], f32[64]{{0}}) tuple(%n, %_mxfp4_gmm.3)
}}

%cond (p: (s32[], f32[64])) -> pred[] {{
  %p = (s32[], f32[64]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %lim = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %lim), direction=LT
}}

ENTRY %main (a: f32[64]) -> f32[64] {{
  %a = f32[64]{{0}} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[64]{{0}}) tuple(%zero, %a)
  %w = (s32[], f32[64]{{0}}) while(%init), condition=%cond, body=%body
  %y = f32[64]{{0}} get-tuple-element(%w), index=1
  ROOT %other.1 = f32[64]{{0}} custom-call(%y), custom_call_target="tpu_custom_call", backend_config={{"custom_call_config":{{"body":"AAAA"}}}}
}}
"""
  c = program_costs(hlo)
  assert c.kernels == {"mxfp4_gmm": {"count": 3, "flops": 3000.0, "hbm_bytes": 1500.0}}
  assert c.custom_calls == {"tpu_custom_call": {"count": 1, "output_bytes": 256.0}}
  assert c.flops == 3000.0
  # the estimates, the other call's operand and output, and the loop counter's add and
  # compare (12 and 9 bytes) three times
  assert c.hbm_bytes == 1500.0 + 256 + 256 + 3 * (12 + 9)
  r = roofline(c, "v5p")
  assert r["pallas_kernels"]["mxfp4_gmm"]["count"] == 3
  assert r["not_counted"]["custom_calls"]["tpu_custom_call"]["count"] == 1


def test_an_in_place_scatter_touches_only_its_rows():
  """A pool written by a scatter (a fusion whose root scatters into its operand 0, which
  nothing else reads) touches the rows it writes, not the pool: here 2 rows of 8 x 4 f32."""
  from pod.roofline import program_costs
  hlo = """HloModule m, entry_computation_layout={(f32[1000,8,4]{2,1,0}, s32[2,1]{1,0}, f32[2,8,4]{2,1,0})->f32[1000,8,4]{2,1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  ROOT %b = f32[] parameter(1)
}

%fused (param_0: f32[1000,8,4], param_1: s32[2,1], param_2: f32[2,8,4]) -> f32[1000,8,4] {
  %param_0 = f32[1000,8,4]{2,1,0} parameter(0)
  %param_1 = s32[2,1]{1,0} parameter(1)
  %param_2 = f32[2,8,4]{2,1,0} parameter(2)
  ROOT %s = f32[1000,8,4]{2,1,0} scatter(%param_0, %param_1, %param_2), update_window_dims={1,2}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

ENTRY %main (pool: f32[1000,8,4], idx: s32[2,1], new: f32[2,8,4]) -> f32[1000,8,4] {
  %pool = f32[1000,8,4]{2,1,0} parameter(0)
  %idx = s32[2,1]{1,0} parameter(1)
  %new = f32[2,8,4]{2,1,0} parameter(2)
  ROOT %f = f32[1000,8,4]{2,1,0} fusion(%pool, %idx, %new), kind=kLoop, calls=%fused
}
"""
  rows = 2 * 8 * 4 * 4
  assert program_costs(hlo).hbm_bytes == rows + 8 + rows + rows   # pool rows, indices, updates


def test_a_nested_fusion_slicing_the_stack_with_its_index_reads_the_slice():
  """A matmul fusion whose operand is a nested loop fusion of (stacked weights, layer
  index) that slices the layer reads that layer, not the stack."""
  from pod.roofline import program_costs
  hlo = """HloModule m, entry_computation_layout={(bf16[22,16,8]{2,1,0}, s32[], bf16[2,16]{1,0})->f32[2,8]{1,0}}

%slice_fusion (p0: bf16[22,16,8], p1: s32[]) -> bf16[16,8] {
  %p0 = bf16[22,16,8]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = bf16[1,16,8]{2,1,0} dynamic-slice(%p0, %p1, %zero, %zero), dynamic_slice_sizes={1,16,8}
  ROOT %b = bf16[16,8]{1,0} bitcast(%ds)
}

%fused (param_0: bf16[22,16,8], param_1: s32[], param_2: bf16[2,16]) -> f32[2,8] {
  %param_0 = bf16[22,16,8]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %param_2 = bf16[2,16]{1,0} parameter(2)
  %w = bf16[16,8]{1,0} fusion(%param_0, %param_1), kind=kLoop, calls=%slice_fusion
  ROOT %d = f32[2,8]{1,0} dot(%param_2, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: bf16[22,16,8], i: s32[], x: bf16[2,16]) -> f32[2,8] {
  %w = bf16[22,16,8]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = bf16[2,16]{1,0} parameter(2)
  ROOT %f = f32[2,8]{1,0} fusion(%w, %i, %x), kind=kOutput, calls=%fused
}
"""
  # the layer's 16 x 8 bf16 (not 22 of them), the index, x, the f32 result
  assert program_costs(hlo).hbm_bytes == 16 * 8 * 2 + 4 + 2 * 16 * 2 + 2 * 8 * 4


def test_on_chip_buffers_are_not_hbm_traffic():
  """A buffer the compiler placed in VMEM (S(1) in its layout) costs no HBM bytes: a
  prefetch (copy-start) reads HBM once, and the fusion reading the prefetched copy reads
  only its other, HBM, operand."""
  from pod.roofline import program_costs
  hlo = """HloModule m, entry_computation_layout={(f32[256]{0}, f32[256]{0})->f32[256]{0}}

%fused (p0: f32[256], p1: f32[256]) -> f32[256] {
  %p0 = f32[256]{0:S(1)} parameter(0)
  %p1 = f32[256]{0} parameter(1)
  ROOT %a = f32[256]{0} add(%p0, %p1)
}

ENTRY %main (a: f32[256], b: f32[256]) -> f32[256] {
  %a = f32[256]{0} parameter(0)
  %b = f32[256]{0} parameter(1)
  %cs = (f32[256]{0:S(1)}, f32[256]{0}, u32[]) copy-start(%a)
  %cd = f32[256]{0:S(1)} copy-done(%cs)
  ROOT %f = f32[256]{0} fusion(%cd, %b), kind=kLoop, calls=%fused
}
"""
  # copy-start: reads a (1 KiB); fusion: reads b, writes its result (1 KiB each)
  assert program_costs(hlo).hbm_bytes == 3 * 1024
  assert program_costs(hlo, hbm_only=False).hbm_bytes > 3 * 1024


def test_an_allocated_buffer_is_not_hbm_traffic():
  """`jax.lax.empty` on TPU (custom call AllocateBuffer: a buffer, nothing written) costs
  no HBM bytes; its consumer's bytes count as usual."""
  from pod.roofline import program_costs
  hlo = """HloModule m, entry_computation_layout={(f32[256]{0})->f32[256]{0}}

ENTRY %main (a: f32[256]) -> f32[256] {
  %a = f32[256]{0} parameter(0)
  %e = f32[256]{0} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %s = f32[256]{0} add(%a, %e)
}
"""
  assert program_costs(hlo).hbm_bytes == 3 * 1024     # add: two reads and a write
