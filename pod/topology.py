"""Compile-only TPU devices for ahead-of-time compilation from a machine without a TPU.

libtpu (installed with jax[tpu]) can describe a TPU slice it is not attached to:
`jax.experimental.topologies.get_topology_desc` returns devices that jit can
lower and compile for, but never run on. Everything that compiles for a TPU
target from this CPU machine (the `compile` command, the kernel compile tests,
the compile benchmarks) gets its devices here.

Targets are named either explicitly ("v5p:8x16x16": generation and chip grid) or
as Cloud TPU accelerator types ("v5p-4096"). Cloud names count TensorCores for
v4/v5p (two per chip: v5p-4096 = 2048 chips) and chips for v5e/v6e (v5e-256 =
256 chips); `CLOUD_TOPOLOGIES` maps each to its chip grid.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re

from k3_jax.config import ConfigError

GiB = 1024 ** 3

# libtpu probes the GCE metadata server and the TPU_* environment when it
# initialises; on a machine without a TPU that prints errors that are not ours.
# Giving it a harmless description of "this host" keeps the output clean. Must
# run before libtpu initialises (the first get_topology_desc call).
_QUIET_LIBTPU_ENV = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_ACCELERATOR_TYPE": "v5p-8",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    # libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) so two processes cannot drive
    # one TPU; compile-only devices drive nothing, so concurrent compiles may share it.
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}

# HBM per chip (bytes) by generation.
CHIP_HBM = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}

# Cloud TPU accelerator types -> chip grid. v4 / v5p sizes count TensorCores
# (2 per chip); v5e / v6e sizes count chips.
_CUBE = {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8",
         512: "4x8x8", 1024: "8x8x8", 2048: "8x8x16", 4096: "8x16x16", 8192: "16x16x16",
         12288: "16x16x24", 16384: "16x16x32"}
_PLANE = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
          256: "16x16"}
CLOUD_TOPOLOGIES: dict[str, str] = {
    **{f"v4-{n}": f"v4:{t}" for n, t in _CUBE.items() if n <= 4096},
    **{f"v5p-{n}": f"v5p:{t}" for n, t in _CUBE.items()},
    **{f"v5e-{n}": f"v5e:{t}" for n, t in _PLANE.items()},
    **{f"v5litepod-{n}": f"v5e:{t}" for n, t in _PLANE.items()},
    **{f"v6e-{n}": f"v6e:{t}" for n, t in _PLANE.items()},
}


@dataclasses.dataclass(frozen=True)
class Target:
  """A TPU compile target: `topology` ("v5p:8x16x16") x `num_slices`."""
  name: str             # as given
  generation: str       # v4 | v5e | v5p | v6e
  topology: str         # explicit chip grid, e.g. "v5p:8x16x16"
  num_slices: int
  chips: int            # in all slices
  chip_hbm_bytes: int


def resolve_target(name: str, num_slices: int = 1) -> Target:
  """'v5p-4096' | 'v5p:8x16x16' (optionally 'N*' for N slices, e.g. '2*v5p-128') -> Target."""
  raw = name.strip()
  m = re.fullmatch(r"(\d+)\s*[*x]\s*(.+)", raw) if "*" in raw else None
  if m:
    num_slices, raw = num_slices * int(m.group(1)), m.group(2)
  if num_slices < 1:
    raise ConfigError(f"topology {name!r}: the number of slices must be >= 1")
  topo = CLOUD_TOPOLOGIES.get(raw.lower())
  if topo is None:
    m = re.fullmatch(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})", raw.lower())
    if not m:
      known = ", ".join(sorted(CLOUD_TOPOLOGIES, key=lambda s: (s.split("-")[0],
                                                                int(s.split("-")[1]))))
      raise ConfigError(f"topology {name!r} is neither a Cloud TPU name ({known}) nor an "
                       f"explicit topology like 'v5p:8x16x16' or 'v5e:16x16'")
    topo = raw.lower()
  gen, grid = topo.split(":")
  chips = math.prod(int(x) for x in grid.split("x")) * num_slices
  return Target(name, gen, topo, num_slices, chips, CHIP_HBM[gen])


def quiet_libtpu_env() -> None:
  for key, value in _QUIET_LIBTPU_ENV.items():
    os.environ.setdefault(key, value)


@functools.lru_cache(maxsize=None)
def topology_devices(topology: str, num_slices: int = 1) -> tuple:
  """Compile-only devices of an explicit TPU topology, e.g. "v5p:2x2x1", "v5e:2x2", "v6e:4x4";
  with num_slices > 1, that many slices (devices carry `slice_index`)."""
  quiet_libtpu_env()
  from jax.experimental import topologies
  kw = {"num_slices": num_slices} if num_slices > 1 else {}
  desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, **kw)
  return tuple(desc.devices)


def target_devices(target: Target) -> tuple:
  return topology_devices(target.topology, target.num_slices)
