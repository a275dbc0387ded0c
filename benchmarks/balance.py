"""Expert balance over the first training steps: Quantile Balancing vs sign update vs none.

    python -m benchmarks.balance [--steps=200] [--batch_size=4] [--seq_len=128] [--out=DIR]

Trains the same model (k3_small by default: 32 experts, top-2, 8 MoE layers) from the
same initialisation on the same stdlib batches three times, changing only
`moe.balance`, and records after every step the worst (over MoE layers) ratio of the
most loaded expert's tokens to the mean, and the number of experts with no tokens.
Prints a table, writes balance.json and balance.png into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import configs  # noqa: E402
from k3_jax import train  # noqa: E402
from k3_jax.config import apply_overrides  # noqa: E402
from k3_jax.data import pipeline, sources, tokenizers  # noqa: E402
from sharding.mesh import make_mesh  # noqa: E402

METHODS = ("qb", "sign", "none")
REPORT_STEPS = (1, 10, 25, 50, 100, 150, 200)


def run_method(method: str, args, docs) -> dict:
  cfg = apply_overrides(configs.get(args.config), [f"moe.balance={method}",
                                                   f"moe.balance_rate={args.sign_rate}"])
  tc = dataclasses.replace(configs.get_train(args.config), steps=args.steps,
                           batch_size=args.batch_size, seq_len=args.seq_len)
  steps = train.build_steps(cfg, tc, make_mesh(devices=jax.devices()[:1]))
  data = pipeline.make_dataset(docs, tokenizers.ByteTokenizer(), tc.seq_len, tc.batch_size,
                               seed=0)
  state = steps.init()
  ratio, ratio_avg, zero, loss = [], [], [], []
  t0 = time.time()
  for i in range(args.steps):
    state, m = steps.train(state, train.put_batch(next(data), steps.batch_sharding))
    m = jax.device_get(m)
    ratio.append(float(m["load_max_mean"]))
    ratio_avg.append(float(m["load_max_mean_avg"]))
    zero.append(int(m["zero_load_experts"]))
    loss.append(float(m["loss"]))
    if (i + 1) % 50 == 0:
      print(f"  {method}: step {i + 1}/{args.steps} max/mean {ratio[-1]:.2f} "
            f"loss {loss[-1]:.3f} ({time.time() - t0:.0f}s)", flush=True)
  return {"max_over_mean_worst_layer": ratio, "max_over_mean_layer_avg": ratio_avg,
          "zero_load_experts_worst_layer": zero, "loss": loss}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="k3_small")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--batch_size", type=int, default=4)
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--sign_rate", type=float, default=1e-3)
  p.add_argument("--out", default="runs/benchmarks")
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  docs = sources.stdlib_documents("train")
  results = {}
  for method in METHODS:
    print(f"training with moe.balance={method} ...", flush=True)
    results[method] = run_method(method, args, docs)

  steps = [s for s in REPORT_STEPS if s <= args.steps]
  print(f"\nmax/mean expert load, worst MoE layer ({args.config}, batch {args.batch_size} x "
        f"{args.seq_len}); last column: mean over the last 50 steps; zero: experts with no "
        f"tokens (worst layer, last step)\n")
  print("| method | " + " | ".join(f"step {s}" for s in steps) + " | last 50 | zero |")
  print("|---" * (len(steps) + 3) + "|")
  for method, r in results.items():
    series = r["max_over_mean_worst_layer"]
    cells = [f"{series[s - 1]:.2f}" for s in steps]
    print(f"| {method} | " + " | ".join(cells) +
          f" | {np.mean(series[-50:]):.2f} | {r['zero_load_experts_worst_layer'][-1]} |")
  with open(os.path.join(args.out, "balance.json"), "w") as f:
    json.dump({"args": vars(args), "results": results}, f)

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for method, r in results.items():
    ax.plot(np.arange(1, args.steps + 1), r["max_over_mean_worst_layer"], label=method)
  ax.set_xlabel("step")
  ax.set_ylabel("max / mean expert load (worst MoE layer)")
  ax.set_title(f"{args.config}: Quantile Balancing vs sign update vs none")
  ax.axhline(1.0, color="gray", lw=0.5)
  ax.legend()
  fig.tight_layout()
  path = os.path.join(args.out, "balance.png")
  fig.savefig(path, dpi=110)
  print(f"\nwrote {path} and balance.json")


if __name__ == "__main__":
  main()
