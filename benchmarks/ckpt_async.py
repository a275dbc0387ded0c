"""Train-step time with and without an asynchronous checkpoint save in flight.

    python -m benchmarks.ckpt_async [--config=k3_tiny] [--batch_size=4] [--seq_len=64]
                                    [--rounds=8] [--out=DIR]

Compiles the real train step (k3_jax.train), then alternates (so machine load hits both
alike) rounds of
  - plain: two steps, each timed to completion (block_until_ready), no save anywhere;
  - saving: `CheckpointManager.save` of the current state (Orbax async: returns once the
    arrays are copied off the device), then the same two steps timed while the write runs
    in the background; then the save is waited for (not timed as a step).
Reports medians of the step times, the blocking part of `save()` and the whole save, and
whether the save was still in flight when the steps ended (else the comparison is moot).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import configs  # noqa: E402
from k3_jax import train  # noqa: E402
from k3_jax.checkpoint.manager import CheckpointManager  # noqa: E402
from k3_jax.data import mqar  # noqa: E402
from sharding.mesh import make_mesh  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="k3_tiny")
  ap.add_argument("--batch_size", type=int, default=4)
  ap.add_argument("--seq_len", type=int, default=64)
  ap.add_argument("--rounds", type=int, default=8)
  ap.add_argument("--out", default=None, help="write ckpt_async.json here")
  a = ap.parse_args()
  cfg = configs.get(a.config)
  tc = dataclasses.replace(configs.get_train(a.config), batch_size=a.batch_size,
                           seq_len=a.seq_len, steps=10_000)
  mesh = make_mesh(devices=jax.devices()[:1])
  steps = train.build_steps(cfg, tc, mesh)
  data = mqar.mqar_dataset(a.batch_size, a.seq_len, cfg.vocab_size, num_kv_pairs=4, seed=0)
  state = steps.init()

  def step(state):
    batch = train.put_batch(next(data), steps.batch_sharding)
    t0 = time.perf_counter()
    state, m = steps.train(state, batch)
    jax.block_until_ready((state, m))
    return state, time.perf_counter() - t0

  for _ in range(3):                                   # compile and warm up
    state, _ = step(state)
  plain, saving, blocking, whole, in_flight = [], [], [], [], 0
  with tempfile.TemporaryDirectory() as wd:
    ckpt = CheckpointManager(wd, cfg, keep=2)
    for r in range(a.rounds):
      for _ in range(2):
        state, t = step(state)
        plain.append(t)
      t0 = time.perf_counter()
      ckpt.save(1000 + r, state, data.get_state())
      blocking.append(time.perf_counter() - t0)
      for _ in range(2):
        state, t = step(state)
        saving.append(t)
      in_flight += int(ckpt._mgr.is_saving_in_progress())
      ckpt.wait()
      whole.append(time.perf_counter() - t0)
    ckpt.close()
  med = lambda xs: statistics.median(xs) * 1e3
  rep = {"config": a.config, "batch_size": a.batch_size, "seq_len": a.seq_len,
         "rounds": a.rounds, "backend": jax.default_backend(),
         "step_ms_plain": med(plain), "step_ms_save_in_flight": med(saving),
         "save_call_blocking_ms": med(blocking), "save_total_ms": med(whole),
         "rounds_with_save_still_in_flight_after_steps": in_flight}
  print(f"{a.config} batch {a.batch_size} x {a.seq_len} on {rep['backend']}, "
        f"{a.rounds} rounds (medians):")
  print(f"  train step, no save              {rep['step_ms_plain']:8.1f} ms")
  print(f"  train step, async save in flight {rep['step_ms_save_in_flight']:8.1f} ms")
  print(f"  save() call (blocking part)      {rep['save_call_blocking_ms']:8.1f} ms")
  print(f"  whole save (to wait() returning) {rep['save_total_ms']:8.1f} ms")
  print(f"  save still in flight after the 2 steps in {in_flight}/{a.rounds} rounds")
  if a.out:
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "ckpt_async.json"), "w") as f:
      json.dump(rep, f, indent=1)


if __name__ == "__main__":
  main()
