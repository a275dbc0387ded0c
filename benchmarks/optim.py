"""Per-Head Muon vs AdamW: loss curves and optimizer-step time, in one run.

    python -m benchmarks.optim [--config=k3_small] [--steps=120] [--batch_size=8]
                               [--seq_len=256] [--muon_lr=X] [--learning_rate=X] [--out=DIR]
                               [--optimizers=muon,adamw] [--timing=all|update|none]

Trains the same model (k3_small by default) from the same initialisation on the same
stdlib batches (the default data, seed 0) twice: with optimizer="muon" (Per-Head Muon on
matrices, AdamW on the rest) and optimizer="adamw" (AdamW everywhere), each with the
preset's learning rates and a cosine schedule over --steps. Then, side by side
(alternating A, B, A, B, ... so machine load hits both alike), it times
  - the optimizer update alone (jitted `optimizer.update` on the model's parameter tree
    with fixed random gradients), and
  - the whole train step,
and reports the Muon / AdamW ratios (medians). Prints a table, writes optim.json and
optim.png into --out. On a crowded machine the pieces can run as separate processes:
--optimizers=adamw --timing=none writes only that curve (optim_adamw.json);
--steps=0 --timing=update times the optimizer updates alone on a freshly initialised state.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import configs  # noqa: E402
from k3_jax import train  # noqa: E402
from k3_jax.data import pipeline, sources, tokenizers  # noqa: E402
from sharding.mesh import make_mesh  # noqa: E402

OPTIMIZERS = ("muon", "adamw")


def train_config(args, optimizer: str):
  tc = dataclasses.replace(configs.get_train(args.config), steps=args.steps,
                           batch_size=args.batch_size, seq_len=args.seq_len,
                           optimizer=optimizer)
  if args.muon_lr:
    tc = dataclasses.replace(tc, muon_lr=args.muon_lr)
  if args.learning_rate:
    tc = dataclasses.replace(tc, learning_rate=args.learning_rate)
  return tc


def run_curve(cfg, tc, mesh, docs):
  steps = train.build_steps(cfg, tc, mesh)
  data = pipeline.make_dataset(docs, tokenizers.ByteTokenizer(), tc.seq_len, tc.batch_size,
                               seed=0)
  state = steps.init()
  losses, clipped = [], []
  t0 = time.time()
  for i in range(tc.steps):
    state, m = steps.train(state, train.put_batch(next(data), steps.batch_sharding))
    m = jax.device_get(m)
    losses.append(float(m["loss"]))
    clipped.append(int(m.get("qk_clipped_heads", 0)))
    if (i + 1) % 20 == 0 or i == 0:
      print(f"  {tc.optimizer}: step {i + 1}/{tc.steps} loss {losses[-1]:.4f} "
            f"({time.time() - t0:.0f}s)", flush=True)
  return steps, state, data, losses, clipped


def _median_time(fn, reps: int) -> list[float]:
  out = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(time.perf_counter() - t)
  return out


def time_side_by_side(fns: dict, rounds: int) -> dict:
  """{name: median seconds}, calling the functions in alternation, `rounds` times each."""
  times = {k: [] for k in fns}
  for _ in range(rounds):
    for k, fn in fns.items():
      times[k] += _median_time(fn, 1)
  return {k: float(np.median(v)) for k, v in times.items()}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="k3_small")
  p.add_argument("--steps", type=int, default=120)
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--seq_len", type=int, default=256)
  p.add_argument("--muon_lr", type=float, default=0.0, help="default: the preset's")
  p.add_argument("--learning_rate", type=float, default=0.0, help="AdamW lr; default: preset's")
  p.add_argument("--timing_rounds", type=int, default=7)
  p.add_argument("--out", default="benchmarks/results")
  p.add_argument("--optimizers", default="muon,adamw")
  p.add_argument("--timing", default="all", choices=("all", "update", "none"))
  args = p.parse_args()
  opts = tuple(args.optimizers.split(","))
  os.makedirs(args.out, exist_ok=True)
  cfg = configs.get(args.config)
  mesh = make_mesh(devices=jax.devices()[:1])
  docs = sources.stdlib_documents("train")
  load0 = os.getloadavg()[0]
  print(f"{args.config}: {args.steps} steps, batch {args.batch_size} x {args.seq_len}, "
        f"load average {load0:.1f} on {os.cpu_count()} CPUs", flush=True)

  runs = {}
  for opt in opts:
    tc = train_config(args, opt)
    if args.steps == 0:                # timing only: an initialised state, no curve
      steps = train.build_steps(cfg, dataclasses.replace(tc, steps=100), mesh) \
          if args.timing == "all" else None
      if steps is None:
        optimizer = train.make_optimizer(tc)
        _, params, _ = train.split_model(train.create_model(cfg, seed=tc.seed))
        state = {"params": params, "opt_state": optimizer.init(params)}
      else:
        state = steps.init()
      data = pipeline.make_dataset(docs, tokenizers.ByteTokenizer(), tc.seq_len,
                                   tc.batch_size, seed=0)
      runs[opt] = (tc, steps, state, data, [], [])
    else:
      runs[opt] = (tc, *run_curve(cfg, tc, mesh, docs))
    if args.timing == "none":
      with open(os.path.join(args.out, f"optim_{opt}.json"), "w") as f:
        json.dump({"config": args.config, "steps": args.steps, "optimizer": opt,
                   "muon_lr": tc.muon_lr, "adamw_lr": tc.learning_rate, "loss": runs[opt][4],
                   "qk_clipped_heads": runs[opt][5]}, f)
  if args.timing == "none" or len(opts) < 2:
    print("curves written; no timing")
    return

  # Optimizer update alone: jitted update on the parameter tree with fixed random grads.
  update_fns, step_fns = {}, {}
  for opt, (tc, steps, state, data, _, _) in runs.items():
    optimizer = train.make_optimizer(tc)
    # Copies: the train-step timing below donates (deletes) the state's buffers.
    params = jax.tree.map(jnp.copy, state["params"])
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    grads = jax.tree.unflatten(treedef, [1e-3 * jax.random.normal(k, l.shape, l.dtype)
                                         for k, l in zip(keys, leaves)])
    upd = jax.jit(optimizer.update)
    opt_state = jax.tree.map(jnp.copy, state["opt_state"])
    jax.block_until_ready(upd(grads, opt_state, params))      # compile
    update_fns[opt] = (lambda u=upd, g=grads, s=opt_state, w=params: u(g, s, w)[0])
    if args.timing == "all":
      batch = train.put_batch(next(data), steps.batch_sharding)
      holder = {"state": state}

      def step_once(steps=steps, batch=batch, holder=holder):
        holder["state"], m = steps.train(holder["state"], batch)
        return m["loss"]
      step_once()                                              # compile (steps == 0)
      step_fns[opt] = step_once
  upd_t = time_side_by_side(update_fns, args.timing_rounds)
  step_t = (time_side_by_side(step_fns, args.timing_rounds) if step_fns
            else {"muon": float("nan"), "adamw": float("nan")})
  load1 = os.getloadavg()[0]

  report = {"config": args.config, "steps": args.steps, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "load_average_start_end": [load0, load1],
            "muon_lr": runs["muon"][0].muon_lr, "adamw_lr": runs["adamw"][0].learning_rate,
            "loss": {o: r[4] for o, r in runs.items()},
            "qk_clipped_heads_total": {o: int(sum(r[5])) for o, r in runs.items()},
            "optimizer_update_s": upd_t, "train_step_s": step_t,
            "update_time_ratio_muon_over_adamw": upd_t["muon"] / upd_t["adamw"],
            "step_time_ratio_muon_over_adamw": step_t["muon"] / step_t["adamw"]}

  def avg(xs, i):  # mean over a 10-step window ending at step i (1-based) to smooth noise
    return float(np.mean(xs[max(0, i - 10):i]))

  marks = sorted({1, 10, 25, 50, 75, 100, args.steps} & set(range(1, args.steps + 1)))
  print(f"\nloss (mean of the 10 steps ending at step; same init and batches)")
  print(f"{'step':>6} | {'muon':>8} | {'adamw':>8}")
  for i in marks:
    print(f"{i:>6} | {avg(report['loss']['muon'], i):8.4f} | {avg(report['loss']['adamw'], i):8.4f}")
  print(f"\n{'time (median of ' + str(args.timing_rounds) + ', s)':<28} | {'muon':>8} | "
        f"{'adamw':>8} | ratio")
  print(f"{'optimizer update':<28} | {upd_t['muon']:8.4f} | {upd_t['adamw']:8.4f} | "
        f"{report['update_time_ratio_muon_over_adamw']:.2f}")
  print(f"{'whole train step':<28} | {step_t['muon']:8.4f} | {step_t['adamw']:8.4f} | "
        f"{report['step_time_ratio_muon_over_adamw']:.2f}")
  print(f"QK-Clip heads clipped over the run: {report['qk_clipped_heads_total']}; "
        f"load average {load0:.1f} -> {load1:.1f}")
  with open(os.path.join(args.out, "optim.json"), "w") as f:
    json.dump(report, f, indent=1)
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for o in OPTIMIZERS:
      ax.plot(range(1, args.steps + 1), report["loss"][o], label=o, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats / byte)")
    ax.set_title(f"{args.config}: Per-Head Muon vs AdamW (same init and batches)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "optim.png"), dpi=120)
  except ImportError:
    print("matplotlib not installed: no PNG")
  print(f"wrote {args.out}/optim.json and optim.png")


if __name__ == "__main__":
  main()
