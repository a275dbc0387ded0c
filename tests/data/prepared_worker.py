"""One process of a multi-process CPU job reading a prepared dataset, for
tests/data/test_prepared_multihost.py (not a test itself).

  PYTHONPATH=. python tests/data/prepared_worker.py DATA_DIR NUM_PROCESSES PROCESS_ID PORT DEVICES

Joins the job (pod.distributed), reads this process's rows of 4 global batches with
datasets.train_data (as `train --dataset=DIR` does: its own shards only, the state gathered
over the processes), puts them on the global mesh with train.put_batch, gathers the global
arrays back and prints them (process 0) with the data state saved after batch 2 and the two
batches a fresh iterator restored from that state gives.
"""

import dataclasses
import json
import os
import sys

DATA, NPROC, PID, PORT, NDEV = sys.argv[1], *map(int, sys.argv[2:6])
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={NDEV}"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from pod.distributed import maybe_initialize  # noqa: E402

if NPROC > 1:
  maybe_initialize(f"localhost:{PORT}", NPROC, PID)

import configs  # noqa: E402
from k3_jax import train  # noqa: E402
from k3_jax.data import datasets  # noqa: E402
from sharding.mesh import make_mesh, parse_mesh  # noqa: E402

assert jax.process_count() == NPROC and jax.device_count() == NPROC * NDEV


def main() -> None:
  cfg = configs.get("k3_tiny")
  tc = dataclasses.replace(configs.get_train("k3_tiny"), batch_size=8, seq_len=32,
                           dataset=DATA, seed=7)
  mesh = make_mesh(parse_mesh("fsdp:-1"))
  sh = NamedSharding(mesh, P(("data", "fsdp")))
  replicate = jax.jit(lambda b: b, out_shardings=NamedSharding(mesh, P()))

  def global_batch(it):
    local = next(it)
    g = replicate(train.put_batch(local, sh))
    return {k: np.asarray(v).tolist() for k, v in g.items()}

  it, evals = datasets.train_data(cfg, tc, jax.process_index(), jax.process_count())
  files = sorted(os.path.basename(f) for f in it.shard_files)
  batches = [global_batch(it) for _ in range(2)]
  state = it.get_state()                      # a collective: every process calls it
  batches += [global_batch(it) for _ in range(2)]
  fresh, _ = datasets.train_data(cfg, tc, jax.process_index(), jax.process_count())
  fresh.set_state(json.loads(json.dumps(state)))
  resumed = [global_batch(fresh) for _ in range(2)]
  print(f"PROCESS {PID} shards {files}", flush=True)
  if jax.process_index() == 0:
    print("RESULT " + json.dumps({"batches": batches, "state": state, "resumed": resumed,
                                  "files": files}), flush=True)


if __name__ == "__main__":
  main()
