"""Compile-only TPU devices for ahead-of-time compilation from a machine without a TPU.

libtpu (installed with jax[tpu]) can describe a TPU slice it is not attached to:
`jax.experimental.topologies.get_topology_desc` returns devices that jit can
lower and compile for, but never run on. Everything that compiles for a TPU
target from this CPU machine (the `compile` command, the kernel compile tests,
the compile benchmarks) gets its devices here.
"""

from __future__ import annotations

import functools
import os

# libtpu probes the GCE metadata server and the TPU_* environment when it
# initialises; on a machine without a TPU that prints errors that are not ours.
# Giving it a harmless description of "this host" keeps the output clean. Must
# run before libtpu initialises (the first get_topology_desc call).
_QUIET_LIBTPU_ENV = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_ACCELERATOR_TYPE": "v5p-8",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}


def quiet_libtpu_env() -> None:
  for key, value in _QUIET_LIBTPU_ENV.items():
    os.environ.setdefault(key, value)


@functools.lru_cache(maxsize=None)
def topology_devices(topology: str) -> tuple:
  """Compile-only devices of an explicit TPU topology, e.g. "v5p:2x2x1", "v5e:2x2", "v6e:4x4"."""
  quiet_libtpu_env()
  from jax.experimental import topologies
  desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
  return tuple(desc.devices)
