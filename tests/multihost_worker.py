"""One process of a multi-process CPU job, for tests/test_multihost.py (not a test itself).

  PYTHONPATH=. python tests/multihost_worker.py MODE NUM_PROCESSES PROCESS_ID PORT DEVICES_PER_PROCESS

Joins the job through pod.distributed.maybe_initialize (skipped for 1 process), builds
the same global mesh in every process, feeds THIS process's rows of fixed global batches
through train.put_batch, and prints one JSON line of results (process 0 only):
  MODE=sum    a tiny jitted sharded program: per-row sums of (batch @ w), w sharded
  MODE=train  k3_tiny train steps (mesh fsdp over all devices): the losses
  MODE=hfload load the Hugging Face directory $K3_HF_DIR straight into sharded arrays
              (checkpoint/sharded_load.py); each process checks its shards against a plain
              load and reports the bytes it read
"""

import json
import os
import sys

MODE, NPROC, PID, PORT, NDEV = sys.argv[1], *map(int, sys.argv[2:6])
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={NDEV}"

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from pod.distributed import maybe_initialize  # noqa: E402

if NPROC > 1:
  maybe_initialize(f"localhost:{PORT}", NPROC, PID)
jax.config.update("jax_default_matmul_precision", "highest")

import configs  # noqa: E402
from k3_jax import train  # noqa: E402
from k3_jax.data import mqar  # noqa: E402
from sharding.mesh import make_mesh, parse_mesh  # noqa: E402

assert jax.process_count() == NPROC and jax.device_count() == NPROC * NDEV


def local_rows(batch: dict) -> dict:
  """This process's contiguous share of each global batch row range."""
  n = next(iter(batch.values())).shape[0] // NPROC
  return {k: v[PID * n:(PID + 1) * n] for k, v in batch.items()}


def main() -> None:
  cfg = configs.get("k3_tiny")
  tc = dataclasses.replace(configs.get_train("k3_tiny"), batch_size=8, seq_len=32,
                           learning_rate=1e-2)
  it = mqar.mqar_dataset(tc.batch_size, tc.seq_len, cfg.vocab_size, num_kv_pairs=4, seed=1)
  batches = [next(it) for _ in range(2)]
  mesh = make_mesh(parse_mesh("fsdp:-1"))
  if MODE == "hfload":
    from k3_jax.checkpoint import convert
    from k3_jax.checkpoint.sharded_load import load_sharded, model_shardings
    d = os.environ["K3_HF_DIR"]
    log = []
    _, arrays = load_sharded(d, lambda c: model_shardings(c, mesh), log=log)
    _, plain = convert.load_flat(d)
    for p, a in arrays.items():
      for shard in a.addressable_shards:
        assert np.asarray(shard.data).tobytes() == plain[p][shard.index].tobytes(), p
    read = sum(n for _, _, n in log)
    owned = sum(np.empty(plain[p].shape, plain[p].dtype)[i].nbytes for p, i, _ in log)
    print(f"PROCESS {PID} read {read} owned {owned}", flush=True)
    result = {"read": read, "owned": owned,
              "total": sum(v.nbytes for v in plain.values())}
    if jax.process_index() == 0:
      print("RESULT " + json.dumps(result), flush=True)
    return
  if MODE == "sum":
    from jax.sharding import NamedSharding, PartitionSpec as P
    sh = NamedSharding(mesh, P(("data", "fsdp")))
    w = np.arange(tc.seq_len * 3, dtype=np.float32).reshape(tc.seq_len, 3) / 100
    w_dev = jax.device_put(w, NamedSharding(mesh, P("fsdp")))    # built from global data
    f = jax.jit(lambda b, w: (b["loss_mask"] + b["inputs"]) @ w,
                out_shardings=NamedSharding(mesh, P()))
    out = [np.asarray(f(train.put_batch(local_rows(b), sh), w_dev)).tolist() for b in batches]
    result = {"out": out}
  else:
    steps = train.build_steps(cfg, tc, mesh)
    state = steps.init()
    losses = []
    for b in batches:
      state, m = steps.train(state, train.put_batch(local_rows(b), steps.batch_sharding))
      losses.append(float(m["loss"]))
    result = {"losses": losses,
              "grad_norm": float(m["grad_norm"])}
  if jax.process_index() == 0:
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
