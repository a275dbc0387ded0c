"""Multi-host start-up: one JAX process per host, joined by `jax.distributed.initialize`.

On a TPU pod every host runs the same command; JAX finds the coordinator and its own
process index from the TPU environment (GCE metadata, TPU_WORKER_HOSTNAMES,
MEGASCALE_* for multi-slice), so `maybe_initialize()` with no arguments is enough there.
Elsewhere (CPU hosts, tests, unusual clusters) the three settings are given explicitly.
After initialisation `jax.devices()` lists every host's devices and each process feeds
its own slice of the global batch (k3_jax/train.put_batch).
"""

from __future__ import annotations

import os

import jax


def on_multi_host_pod() -> bool:
  """True when the environment describes a TPU pod (or cluster) of more than one host."""
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  if "," in hosts:
    return True
  if int(os.environ.get("MEGASCALE_NUM_SLICES", "1") or 1) > 1:
    return True
  return bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))


def maybe_initialize(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> bool:
  """Joins the multi-host job when there is one; returns whether it did.

  Explicit settings (all three, e.g. from --coordinator_address/--num_processes/
  --process_id) win; otherwise a multi-host pod is detected from its environment and
  JAX's own cluster detection fills in the settings. A single host does nothing."""
  _cpu_collectives()
  given = [coordinator_address, num_processes, process_id]
  if any(v is not None for v in given):
    if any(v is None for v in given):
      raise ValueError("multi-host: give all of --coordinator_address, --num_processes and "
                       "--process_id, or none of them (auto-detection on a TPU pod)")
    if not 0 <= process_id < num_processes:
      raise ValueError(f"process_id={process_id} must lie in [0, num_processes="
                       f"{num_processes})")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    return True
  if on_multi_host_pod():
    jax.distributed.initialize()
    return True
  return False


def _cpu_collectives() -> None:
  """XLA:CPU needs a cross-process collectives library (gloo) for multi-process programs;
  must be set before the CPU backend starts. Harmless for TPU jobs."""
  if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def is_primary() -> bool:
  """Process 0: the one that writes metrics and config files (checkpoints: every host)."""
  return jax.process_index() == 0


__all__ = ["on_multi_host_pod", "maybe_initialize", "is_primary"]
