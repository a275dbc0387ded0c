"""MXFP4 grouped matmul vs a BF16 grouped matmul, compiled for TPU v5e, v5p and v6e.

  python -m benchmarks.mxfp4_gmm [--gens v5e,v5p,v6e] [--rows 4096] [--proj up,down]
                                 [--kinds mxfp4,mxfp4+fp8,bf16] [--json out.json]

Ahead-of-time compilation from this CPU machine (libtpu compile-only devices, no TPU
needed): per generation a 4-chip slice (v5e:2x2, v5p:2x2x1, v6e:2x2) with one mesh axis
over all chips, every chip holding E=14 local experts (K3 routed-expert shapes: latent
L=3584, intermediate F=3072) and --rows routed rows (4096) grouped by its local experts.
The gate (= up) projection [rows, L] x [E, L, F] (packed along L) and the down projection
[rows, F] x [E, F, L] (packed along F) are compiled inside jax.shard_map as

  mxfp4        pallas_kernels.mxfp4_gmm (weights packed MXFP4, BF16 lhs)
  mxfp4+fp8    the same kernel with an MXFP8 (E4M3) lhs
  bf16         jax.lax.ragged_dot with BF16 weights (XLA's native grouped matmul)

Columns (per chip): compiled memory_analysis() argument / output / temporary bytes;
"weights read": HBM bytes of expert weights read per call. For the kernel it is analytic
from its tiling: the rhs block copies the TPU pipeline issues (a copy whenever the block
index changes between consecutive grid steps, replayed by `rhs_fetches` on the actual
visit schedule of a ragged group-size pattern) times the block bytes (codes + scales).
For BF16 it is the minimum any grouped matmul can do: every weight of every expert that
has rows read once (L F 2 bytes per non-empty expert; the pattern has one empty expert). "xla bytes": the compiled cost_analysis "bytes accessed" (for the Pallas call this
is the kernel's own CostEstimate, which uses the same analytic weight count; for ragged_dot
it is XLA's estimate). Nothing here runs on a TPU: no times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from k3_jax.ops.mx import MXArray  # noqa: E402
from pallas_kernels.mxfp4_gmm import (default_tiling, group_metadata, mxfp4_gmm,  # noqa: E402
                                      rhs_fetches)
from pod.topology import topology_devices  # noqa: E402

L, F, E = 3584, 3072, 14
TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
AXIS = "expert"
MIB = 1 << 20


def ragged_sizes(rows: int, e: int, seed: int = 0) -> np.ndarray:
  """A ragged routing pattern: Dirichlet-ish shares of `rows`, one expert empty."""
  rng = np.random.default_rng(seed)
  share = rng.gamma(2.0, size=e)
  share[e // 2] = 0.0
  sizes = np.floor(share / share.sum() * rows).astype(np.int64)
  sizes[0] += rows - sizes.sum()
  return sizes.astype(np.int32)


def weight_bytes_mxfp4(rows: int, sizes: np.ndarray, k: int, n: int,
                       lhs_align: int = 16) -> tuple[int, int]:
  """(bytes, copies): rhs bytes the kernel reads per call under its default tiling, for
  a [rows, k] x [E, k, n] grouped matmul."""
  t = default_tiling(rows, k, n, lhs_align)
  m_pad = -(-rows // t.tm) * t.tm
  meta = group_metadata(jnp.asarray(sizes), m_pad, t.tm)
  copies = int(rhs_fetches(meta, n // t.tn, k // t.tk))
  block = (t.tk // 2 + t.tk // 32) * t.tn                       # codes + scales bytes
  return copies * block, copies


def _mesh(gen: str) -> Mesh:
  devs = topology_devices(TOPOLOGIES[gen])
  return Mesh(np.asarray(devs), (AXIS,))


def _sds(shape, dtype, mesh):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(AXIS)))


def compile_gmm(gen: str, kind: str, rows: int = 4096, e: int = E, l: int = L, f: int = F,
                tiling=None):
  """Compiled executable of one grouped matmul `kind` ("mxfp4", "mxfp4+fp8", "mxfp4+q8":
  a BF16 lhs quantised to MXFP8 in the kernel, "mxfp4+q8+glu": that and a gated call,
  "bf16") for
  the generation's 4-chip slice; every chip: rows x l lhs, e local experts of l x f.
  tiling: the kernel's Tiling (None: its default)."""
  mesh = _mesh(gen)
  n = mesh.devices.size
  gs = _sds((n * e,), jnp.int32, mesh)
  if kind == "bf16":
    def local(x, w, g):
      return jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32
                                ).astype(jnp.bfloat16)
    args = (_sds((n * rows, l), jnp.bfloat16, mesh), _sds((n * e, l, f), jnp.bfloat16, mesh),
            gs)
  elif kind == "mxfp4":
    def local(x, wc, ws, g):
      return mxfp4_gmm(x, MXArray(wc, ws, "mxfp4", -2), g, tiling=tiling)
    args = (_sds((n * rows, l), jnp.bfloat16, mesh), _sds((n * e, l // 2, f), jnp.uint8, mesh),
            _sds((n * e, l // 32, f), jnp.uint8, mesh), gs)
  elif kind == "mxfp4+q8":        # a BF16 lhs quantised to MXFP8 E4M3 inside the kernel
    def local(x, wc, ws, g):
      return mxfp4_gmm(x, MXArray(wc, ws, "mxfp4", -2), g, tiling=tiling,
                       lhs_quant="mxfp8_e4m3")
    args = (_sds((n * rows, l), jnp.bfloat16, mesh), _sds((n * e, l // 2, f), jnp.uint8, mesh),
            _sds((n * e, l // 32, f), jnp.uint8, mesh), gs)
  elif kind == "mxfp4+q8+glu":    # ... and a gated call: glu(lhs @ gate, lhs @ up), SiTU
    def local(x, wc, ws, uc, us, g):
      return mxfp4_gmm(x, MXArray(wc, ws, "mxfp4", -2), g, tiling=tiling,
                       lhs_quant="mxfp8_e4m3", rhs_up=MXArray(uc, us, "mxfp4", -2),
                       glu=("situ", 4.0, 25.0))
    args = (_sds((n * rows, l), jnp.bfloat16, mesh),
            *[_sds((n * e,) + s, jnp.uint8, mesh) for s in ((l // 2, f), (l // 32, f)) * 2],
            gs)
  elif kind == "mxfp4+fp8":
    def local(xc, xs, wc, ws, g):
      return mxfp4_gmm(MXArray(xc, xs, "mxfp8_e4m3", -1), MXArray(wc, ws, "mxfp4", -2), g,
                       tiling=tiling)
    args = (_sds((n * rows, l), jnp.uint8, mesh), _sds((n * rows, l // 32), jnp.uint8, mesh),
            _sds((n * e, l // 2, f), jnp.uint8, mesh), _sds((n * e, l // 32, f), jnp.uint8, mesh),
            gs)
  else:
    raise ValueError(f"unknown kind {kind!r}")
  fn = jax.shard_map(local, mesh=mesh, in_specs=tuple(P(AXIS) for _ in args),
                     out_specs=P(AXIS), check_vma=False)
  return jax.jit(fn).lower(*args).compile()


def _bytes_accessed(compiled) -> float | None:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  val = (cost or {}).get("bytes accessed")
  return None if val is None else float(val)


PROJECTIONS = {"up": (L, F), "down": (F, L)}      # (contraction, output width)


def measure(gen: str, kind: str, rows: int, proj: str = "up") -> dict:
  k, n = PROJECTIONS[proj]
  compiled = compile_gmm(gen, kind, rows, l=k, f=n)
  mem = compiled.memory_analysis()
  sizes = ragged_sizes(rows, E)
  if kind == "bf16":
    wbytes, copies = int(np.count_nonzero(sizes)) * k * n * 2, None
  else:
    wbytes, copies = weight_bytes_mxfp4(rows, sizes, k, n, 32 if kind == "mxfp4+fp8" else 16)
  return dict(gen=gen, kind=kind, proj=proj, rows=rows, experts=E, contraction=k, width=n,
              argument_bytes=int(mem.argument_size_in_bytes),
              output_bytes=int(mem.output_size_in_bytes),
              temp_bytes=int(mem.temp_size_in_bytes),
              weight_bytes_read=int(wbytes), rhs_block_copies=copies,
              xla_bytes_accessed=_bytes_accessed(compiled),
              group_sizes=sizes.tolist())


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--gens", default="v5e,v5p,v6e", help="TPU generations, comma-separated")
  p.add_argument("--rows", type=int, default=4096, help="routed rows per chip")
  p.add_argument("--kinds", default="mxfp4,mxfp4+fp8,bf16", help="what to compile")
  p.add_argument("--proj", default="up,down",
                 help="up: [rows, L] x [E, L, F] (gate and up); down: [rows, F] x [E, F, L]")
  p.add_argument("--json", default=None, help="write the results to this JSON file")
  a = p.parse_args(argv)
  results = []
  hdr = (f"{'gen':4} {'proj':4} {'kind':10} {'args MiB':>9} {'out MiB':>8} {'temp MiB':>9} "
         f"{'weights read MiB':>17} {'vs bf16':>8} {'xla bytes MiB':>14}")
  print(f"per chip: {a.rows} routed rows, {E} local experts, L={L}, F={F}; "
        f"group sizes {ragged_sizes(a.rows, E).tolist()}")
  print(hdr)
  for gen in a.gens.split(","):
    for proj in a.proj.split(","):
      row = {}
      for kind in a.kinds.split(","):
        r = measure(gen, kind, a.rows, proj)
        results.append(r)
        row[kind] = r
      base = row.get("bf16", {}).get("weight_bytes_read")
      for kind, r in row.items():
        ratio = f"{base / r['weight_bytes_read']:.2f}x" if base else "-"
        xla = r["xla_bytes_accessed"]
        print(f"{gen:4} {proj:4} {kind:10} {r['argument_bytes'] / MIB:9.1f} "
              f"{r['output_bytes'] / MIB:8.1f} "
              f"{r['temp_bytes'] / MIB:9.1f} {r['weight_bytes_read'] / MIB:17.1f} {ratio:>8} "
              f"{(xla or 0) / MIB:14.1f}")
  if a.json:
    with open(a.json, "w") as fh:
      json.dump(results, fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
