"""Pallas KDA kernels compiled for TPU v5e / v5p / v6e at K3 per-chip shapes, from a CPU host.

  python -m benchmarks.kda_tpu_compile [--quick] [--gens v5e,v5p,v6e] [--json out.json]

Nothing runs: libtpu's compile-only devices (pod.topology) let XLA and Mosaic compile
for a 4-chip slice of each generation (v5e:2x2, v5p:2x2x1, v6e:2x2). Each kernel runs per
chip inside shard_map (sharding.kernels, the path the KDA layer takes on a mesh), heads
split over the 4 chips, so the shapes below are per chip. K = V = 128, chunk 64; q, k, v in
BF16, g, beta and the state in FP32 (what the KDA layer feeds the kernels: the decay stays
FP32 because its cumulative sums over a chunk need the precision).

  fwd       pallas_kernels.kda.chunk_kda, outputs only (training forward)
  fwd+bwd   jax.vjp of it w.r.t. q, k, v, g, beta: o and the input gradients (forward,
            the backward's state recomputation and the backward kernels)
  decode    pallas_kernels.kda_decode.kda_decode_step, state donated (updated in place)

Shapes (B, T, heads per chip): B x T = 64K tokens per chip as one 65536-token sequence or
8 x 8192, at 8, 16 and 24 heads (--quick: 8192 tokens, 8 and 24 heads). Decode: B = 1 and
8 sequences at the same head counts.

Columns: the compiled program's memory per chip from `compiled.memory_analysis()`
(arguments, outputs, temporaries; MiB), then per Pallas kernel the VMEM it asks for:
  blocks   computed from its BlockSpecs and scratch shapes: every in/out block twice
           (Pallas double-buffers them), each padded to TPU tiles (last dim to 128 lanes,
           second-last to 8 rows for 32-bit, 16 for 16-bit dtypes), plus scratch once;
  mosaic   the scoped VMEM the compiled kernel reserves, as the compiled HLO reports it
           (`used_scoped_memory_configs` of its tpu_custom_call; includes Mosaic's own
           internal scratch for intermediate values).
The VMEM capacity per core is printed per generation (pltpu.get_tpu_info_for_chip).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from sharding.kernels import shard_map_kernel  # noqa: E402
from sharding.mesh import make_mesh, parse_mesh  # noqa: E402
from pod.topology import topology_devices  # noqa: E402

GENS = {  # generation -> (topology of 4 chips, chip version, TensorCores per device)
    "v5e": ("v5e:2x2", pltpu.ChipVersion.TPU_V5E, 1),
    "v5p": ("v5p:2x2x1", pltpu.ChipVersion.TPU_V5P, 2),
    "v6e": ("v6e:2x2", pltpu.ChipVersion.TPU_V6E, 1),
}
CHIPS = 4
K = V = 128
CHUNK = 64
MIB = 2.0 ** 20
TOK = ("batch", None, "heads", None)      # [B, T, H, K]
VEC = ("batch", None, "heads")            # [B, T, H]
STATE = ("batch", "heads", None, None)    # [B, H, K, V]


# ----- VMEM asked for by each Pallas kernel ---------------------------------------------

def _tile_bytes(shape, dtype) -> int:
  """Bytes of one buffer of `shape` in VMEM, padded to TPU (sublane, lane) tiles."""
  itemsize = np.dtype(dtype).itemsize
  shape = (1,) * max(0, 2 - len(shape)) + tuple(int(d) for d in shape)
  sublanes = 8 * max(1, 4 // itemsize)
  rows = -(-shape[-2] // sublanes) * sublanes
  lanes = -(-shape[-1] // 128) * 128
  return math.prod(shape[:-2]) * rows * lanes * itemsize


def _sub_jaxprs(value):
  if hasattr(value, "eqns"):
    yield value
  elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
    yield value.jaxpr
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _sub_jaxprs(v)


def pallas_calls(jaxpr):
  """Every pallas_call equation in a jaxpr, nested jaxprs (shard_map, vjp, scan...) included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        yield from pallas_calls(sub)


def kernel_vmem(eqn) -> tuple[str, int, int | None]:
  """(kernel name, block + scratch bytes, vmem_limit_bytes it sets or None)."""
  gm = eqn.params["grid_mapping"]
  blocks = sum(2 * _tile_bytes(bm.block_aval.shape, bm.block_aval.dtype)
               for bm in gm.block_mappings)
  scratch = 0
  for aval in gm.scratch_avals:
    try:
      scratch += _tile_bytes(aval.shape, aval.dtype)
    except (AttributeError, TypeError):  # semaphores: no VMEM array
      pass
  name = eqn.params.get("name") or getattr(eqn.params.get("name_and_src_info"), "name", "?")
  limit = getattr(eqn.params.get("compiler_params"), "vmem_limit_bytes", None)
  return str(name), blocks + scratch, limit


_CALL = re.compile(r"%(\S+) = .*custom_call_target=\"tpu_custom_call\"")
_SCOPED = re.compile(r'used_scoped_memory_configs":\[\{"memory_space":"1","offset":"\d+",'
                     r'"size":"(\d+)"')


def mosaic_scoped_vmem(hlo_text: str) -> list[tuple[str, int]]:
  """(instruction name, scoped VMEM bytes) of every Mosaic kernel in a compiled HLO text."""
  found = []
  for line in hlo_text.splitlines():
    call = _CALL.search(line)
    if call:
      size = _SCOPED.search(line)
      found.append((call.group(1), int(size.group(1)) if size else -1))
  return found


# ----- the compiled programs -----------------------------------------------------------

def _programs(mesh, b, t, h):
  """{pass: (fn, abstract args, donate)} at per-chip (b, t, h); global heads = h * CHIPS."""
  from pallas_kernels import kda as pallas_kda
  from pallas_kernels import kda_decode
  hg = h * CHIPS
  sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(
      shape, dtype, sharding=NamedSharding(mesh, spec))
  tok = lambda dtype: sds((b, t, hg, K), dtype, PartitionSpec(None, None, "tensor", None))
  q, k, v = tok(jnp.bfloat16), tok(jnp.bfloat16), tok(jnp.bfloat16)
  g = tok(jnp.float32)
  beta = sds((b, t, hg), jnp.float32, PartitionSpec(None, None, "tensor"))

  def fwd_local(q, k, v, g, beta):
    return pallas_kda.chunk_kda(q, k, v, g, beta, chunk_size=CHUNK)[0]

  fwd = shard_map_kernel(mesh, fwd_local, [TOK] * 4 + [VEC], TOK)

  def fwd_bwd(q, k, v, g, beta, do):
    o, pullback = jax.vjp(fwd, q, k, v, g, beta)
    return o, pullback(do)          # o too: a train step uses it (else XLA drops the kernel)

  vec = lambda d, dtype: sds((b, hg, d), dtype, PartitionSpec(None, "tensor", None))
  state = sds((b, hg, K, V), jnp.float32, PartitionSpec(None, "tensor", None, None))
  dvec = ("batch", "heads", None)
  decode = shard_map_kernel(mesh, kda_decode.kda_decode_step,
                            [dvec] * 4 + [("batch", "heads"), STATE], (dvec, STATE))
  dbeta = sds((b, hg), jnp.float32, PartitionSpec(None, "tensor"))
  return {
      "fwd": (fwd, (q, k, v, g, beta), ()),
      "fwd+bwd": (fwd_bwd, (q, k, v, g, beta, tok(jnp.bfloat16)), ()),
      "decode": (decode, (vec(K, jnp.bfloat16), vec(K, jnp.bfloat16), vec(V, jnp.bfloat16),
                          vec(K, jnp.float32), dbeta, state), (5,)),
  }


def compile_one(fn, args, donate):
  """Compile; return the memory per chip and the per-kernel VMEM (or the error)."""
  t0 = time.perf_counter()
  jitted = jax.jit(fn, donate_argnums=donate)
  kernels = [kernel_vmem(e) for e in pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr)]
  if not kernels:
    raise RuntimeError("no pallas_call in the traced program")
  try:
    compiled = jitted.lower(*args).compile()
  except Exception as e:  # report, keep going: the table shows what does not compile
    return dict(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                kernels=[dict(name=n, blocks_bytes=b, vmem_limit_bytes=l)
                         for n, b, l in kernels])
  mem = compiled.memory_analysis()
  scoped = mosaic_scoped_vmem(compiled.as_text())
  rows = [dict(name=n, blocks_bytes=b, vmem_limit_bytes=l) for n, b, l in kernels]
  return dict(ok=True, seconds=time.perf_counter() - t0,
              argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
              alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
              kernels=rows, compiled_kernels=[dict(name=n, scoped_vmem_bytes=b)
                                              for n, b in scoped])


def _fmt_traced(kernels) -> str:
  """'name MiB' per traced kernel (with its vmem_limit_bytes if it sets one)."""
  parts = []
  for r in kernels:
    txt = f"{r['name']} {r['blocks_bytes'] / MIB:.2f}"
    if r.get("vmem_limit_bytes"):
      txt += f" (limit {r['vmem_limit_bytes'] / MIB:.0f})"
    parts.append(txt)
  return ", ".join(parts)


def _fmt_compiled(kernels) -> str:
  """'name MiB' per compiled Mosaic kernel (XLA drops a kernel whose outputs are unused,
  e.g. the forward's o when only gradients are returned and the backward recomputes)."""
  return ", ".join(f"{r['name'].split('.')[0]} {r['scoped_vmem_bytes'] / MIB:.2f}"
                   for r in kernels)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="T = 8192 only, 8 and 24 heads")
  p.add_argument("--gens", default="v5e,v5p,v6e", help="comma list of v5e, v5p, v6e")
  p.add_argument("--passes", default="fwd,fwd+bwd,decode", help="comma list of passes")
  p.add_argument("--json", default=None, help="write the results to this file")
  args = p.parse_args()

  heads = (8, 24) if args.quick else (8, 16, 24)
  seqs = ((8, 8192),) if args.quick else ((1, 65536), (8, 8192))
  passes = args.passes.split(",")
  results, failed = [], 0
  for gen in args.gens.split(","):
    topology, chip, cores = GENS[gen]
    mesh = make_mesh(parse_mesh(f"tensor:{CHIPS}"), devices=topology_devices(topology))
    info = pltpu.get_tpu_info_for_chip(chip, cores)
    print(f"{gen} ({topology}): VMEM {info.vmem_capacity_bytes / MIB:.0f} MiB per core, "
          f"HBM {info.hbm_capacity_bytes / 2**30:.0f} GiB per chip", file=sys.stderr,
          flush=True)
    cases = []
    for b, t in seqs:
      for h in heads:
        cases += [(pa, b, t, h) for pa in passes if pa != "decode"]
    for b in (1, 8):
      for h in heads:
        if "decode" in passes:
          cases.append(("decode", b, 1, h))
    for pa, b, t, h in cases:
      fn, fargs, donate = _programs(mesh, b, t, h)[pa]
      r = compile_one(fn, fargs, donate)
      r.update(gen=gen, topology=topology, vmem_capacity_bytes=info.vmem_capacity_bytes,
               hbm_capacity_bytes=info.hbm_capacity_bytes, pass_=pa, B=b,
               T=t if pa != "decode" else None, heads_per_chip=h)
      failed += not r["ok"]
      results.append(r)
      print(f"  {gen} {pa:8s} B={b} T={t if pa != 'decode' else '-'} H={h}: "
            + (f"{r['seconds']:.1f} s" if r["ok"] else r["error"]), file=sys.stderr,
            flush=True)

  print("\nMemory per chip (MiB) from compiled.memory_analysis(); VMEM per kernel (MiB): "
        "from its blocks (x2 buffers) + scratch, and the scoped VMEM Mosaic reserved.\n")
  print("| gen | pass | B | T | H/chip | args | out | temp | VMEM from blocks | Mosaic VMEM |")
  print("|---|---|---:|---:|---:|---:|---:|---:|---|---|")
  for r in results:
    t = "-" if r["T"] is None else r["T"]
    head = f"| {r['gen']} | {r['pass_']} | {r['B']} | {t} | {r['heads_per_chip']} "
    if r["ok"]:
      print(head + f"| {r['argument_bytes'] / MIB:.0f} | {r['output_bytes'] / MIB:.0f} "
            f"| {r['temp_bytes'] / MIB:.0f} | {_fmt_traced(r['kernels'])} "
            f"| {_fmt_compiled(r['compiled_kernels'])} |")
    else:
      print(head + f"| - | - | - | {_fmt_traced(r['kernels'])} | FAILED: {r['error']} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(K=K, V=V, chunk=CHUNK, chips=CHIPS,
                     results=[{("pass" if k == "pass_" else k): v for k, v in r.items()}
                              for r in results]), f, indent=2)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
