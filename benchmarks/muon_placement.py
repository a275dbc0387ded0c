"""Where Newton-Schulz runs on a mesh: owned (each block whole on one chip, k3_jax/optim/
owned.py) vs left to the partitioner, side by side on 8 CPU devices.

    python -m benchmarks.muon_placement [--config=k3_small] [--mesh=fsdp:8] [--steps=6]
                                        [--batch_size=8] [--seq_len=256]

For each placement: the compiled optimizer update alone (its matmul FLOPs per device, which
are Newton-Schulz's, and its collectives, from pod/roofline.py), and the whole train
step timed alternately A, B, A, B, ... (medians, after a warm-up step), so machine load
hits both alike. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

import configs  # noqa: E402
from k3_jax import train  # noqa: E402
from k3_jax.data import pipeline, sources, tokenizers  # noqa: E402
from pod import roofline  # noqa: E402
from sharding.mesh import make_mesh, parse_mesh  # noqa: E402

PLACEMENTS = ("sharded", "owned")


def update_costs(steps, opt) -> dict:
  """Matmul FLOPs per device and collective wire bytes of the optimizer update alone."""
  sh = steps.state_shardings
  fn = jax.jit(lambda g, s, p: opt.update(g, s, p),
               in_shardings=(sh["params"], sh["opt_state"], sh["params"]))
  a = steps.abstract_state
  costs = roofline.program_costs(fn.lower(a["params"], a["opt_state"], a["params"])
                                 .compile().as_text())
  return {"flops_per_device": costs.flops,
          "collective_wire_bytes": {k: v["wire_bytes"] for k, v in costs.collectives.items()}}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default="k3_small")
  ap.add_argument("--mesh", default="fsdp:8")
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--batch_size", type=int, default=8)
  ap.add_argument("--seq_len", type=int, default=256)
  args = ap.parse_args()
  cfg = configs.get(args.config)
  mesh = make_mesh(parse_mesh(args.mesh), jax.devices()[:8])
  docs = sources.stdlib_documents("train")
  out, runs = {}, {}
  for pl in PLACEMENTS:
    tc = dataclasses.replace(configs.get_train(args.config), optimizer="muon",
                             batch_size=args.batch_size, seq_len=args.seq_len,
                             muon_placement=pl)
    steps = train.build_steps(cfg, tc, mesh)
    out[pl] = update_costs(steps, train.make_optimizer(tc, mesh))
    data = pipeline.make_dataset(docs, tokenizers.ByteTokenizer(), tc.seq_len, tc.batch_size,
                                 seed=0)
    state = steps.init()
    batch = train.put_batch(next(data), steps.batch_sharding)
    state, m = steps.train(state, batch)                      # compile + warm-up
    jax.block_until_ready(m)
    runs[pl] = [steps, state, batch, []]
  for _ in range(args.steps):
    for pl in PLACEMENTS:
      steps, state, batch, times = runs[pl]
      t = time.perf_counter()
      state, m = steps.train(state, batch)
      jax.block_until_ready(m)
      times.append(time.perf_counter() - t)
      runs[pl][1] = state
  for pl in PLACEMENTS:
    out[pl]["step_seconds_median"] = statistics.median(runs[pl][3])
    out[pl]["step_seconds"] = runs[pl][3]
  out["optimizer_flops_ratio"] = (out["sharded"]["flops_per_device"]
                                  / out["owned"]["flops_per_device"])
  out["step_time_ratio_owned_vs_sharded"] = (out["owned"]["step_seconds_median"]
                                             / out["sharded"]["step_seconds_median"])
  out.update(config=args.config, mesh=args.mesh, batch_size=args.batch_size,
             seq_len=args.seq_len)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
