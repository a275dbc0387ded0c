"""Host memory and time of ahead-of-time TPU compiles of the k3 train step, against the
sequence split and the number of scanned units.

  python -m benchmarks.compile_memory [--units 2,6] [--seq_splits 1,2,4] [--full]
                                      [--num_slices 2] [--grad_accum 2] [--global_batch B]
                                      [--limit_gb 14] [--timeout 1200] [--json out.json]

Each row is one compile in its own child process (`--one`), so its peak RSS is the
child's own (os.wait4's ru_maxrss); a watchdog polls the child's /proc VmRSS and kills it
beyond --limit_gb (the row then says so). The model is k3 with its layer pattern cut to
U scanned 4-layer units (num_layers = 4 U + 5, MLA every 4th layer and the last: one
unscanned layer in front and four behind, as in k3's 22 units), on
v5p-4096 with fsdp:F, expert:32, sequence:S and F * S = 64, global batch 2048 / S x 8192
(the batch over fsdp x expert, 8192 / S tokens per chip). Columns: the lowered StableHLO
size, its collective counts, lowering and compile seconds, peak RSS, per-chip GiB.
--full adds the full model (22 units) at each split. --num_slices=N: N slices of v5p-4096,
the data axis (N) over them, every slice the one-slice mesh, global batch x N.

What it showed (docs/results.md, Compile host memory): the lowered program barely changes
with the split, and the RSS follows neither the split nor the number of scanned units but
the code to generate: the TPU compiler refuses a step clearly too big right after buffer
assignment (cheap), and code-generates the others in full (LLO lowering of every fusion),
which is where host memory and time go. Since Newton-Schulz became a loop (it was 46% of
the step's fusions and collectives) every row compiles here in 5-10 minutes at 10-15.3 GiB. 2 slices (--num_slices=2): the
2-slice k3 preset 62.84 GiB per chip, 13.70 GiB peak RSS, 22.8 min wall on a loaded machine.
Set LIBTPU_INIT_ARGS in the environment to try compiler options per run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time

OPS = ("all_to_all", "all_gather", "collective_permute", "all_reduce", "reduce_scatter",
       "while", "custom_call")


def hlo_stats(text: str) -> dict:
  """Size of a lowered program's StableHLO text and the count of each op of OPS."""
  out = {"hlo_chars": len(text)}
  for op in OPS:
    out[op] = len(re.findall(rf"stablehlo\.{op}\b", text))
  return out


def one(units: int, seq_split: int, remat: str, batch: int | None, seq_len: int,
        extra: dict) -> dict:
  """Lower and compile one train step (in this process); -> the row (without RSS)."""
  import jax
  import jax.numpy as jnp
  import configs
  from k3_jax import stack, train
  from k3_jax.compile import train_program
  from pod import aot
  from sharding.mesh import make_mesh, parse_mesh
  from pod.topology import resolve_target, target_devices
  aot.limit_malloc_arenas()        # as `main.py compile` does
  cfg = configs.get("k3")
  if units:
    n = 4 * units + 5          # k3's plan: 1 dense layer, `units` scanned units, 4 MoE layers
    cfg = dataclasses.replace(cfg, num_layers=n, mla_layers=tuple(range(4, n, 4)) + (n,))
  run = dataclasses.replace(configs.get_exec("k3"), remat=remat,
                            ep_capacity=extra.get("ep_capacity") or 0.0,
                            grad_accum=extra.get("grad_accum", 1))
  slices = extra.get("num_slices", 1)   # the data axis spans them (sharding/mesh.py)
  tc = dataclasses.replace(configs.get_train("k3"),
                           batch_size=batch or 2048 * slices // seq_split, seq_len=seq_len)
  target = resolve_target(extra.get("topology", "v5p-4096"), slices)
  fsdp = target.chips // slices // 32 // seq_split
  spec = (f"data:{slices}," if slices > 1 else "") + f"fsdp:{fsdp},expert:32,sequence:{seq_split}"
  mesh = make_mesh(parse_mesh(spec), target_devices(target))
  fn, args = train_program(cfg, tc, mesh, dataclasses.replace(run, mesh=spec))
  t0 = time.time()
  lowered = fn.lower(*args)
  t1 = time.time()
  row = {"units": units or stack.plan_of(cfg).repeats, "seq_split": seq_split, "remat": remat,
         "num_slices": slices, "mesh": spec,
         "global_batch": tc.batch_size, "seq_len": seq_len,
         "lower_s": round(t1 - t0, 1), **hlo_stats(lowered.as_text())}
  del lowered
  if extra.get("lower_only"):
    return row
  _, rep = aot.compile_report(fn, args, target.chip_hbm_bytes)
  row.update(compile_s=rep["compile_seconds"],
             per_chip_gib=round(rep["per_chip_total_bytes"] / 2 ** 30, 2),
             temp_gib=round((rep.get("temp_bytes") or 0) / 2 ** 30, 2), fits=rep["fits"])
  if rep.get("compiler_error"):    # refused: the compiler's own words (what it needed)
    row["compiler_error"] = rep["compiler_error"][:300]
  return row


def run_child(spec: dict, limit_gb: float, timeout: float) -> dict:
  """Runs `one(**spec)` in a child process under an RSS watchdog -> the row with
  peak_rss_gb (and killed=... if the watchdog or the timeout stopped it)."""
  cmd = [sys.executable, "-m", "benchmarks.compile_memory", "--one", json.dumps(spec)]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
  killed: list[str] = []

  def watch():
    start = time.time()
    while proc.poll() is None:
      try:
        with open(f"/proc/{proc.pid}/status") as f:
          rss_kb = int(next(l for l in f if l.startswith("VmRSS")).split()[1])
      except (OSError, StopIteration, ValueError):
        rss_kb = 0
      if rss_kb > limit_gb * 2 ** 20:
        killed.append(f"RSS over {limit_gb} GB")
        proc.kill()
      elif time.time() - start > timeout:
        killed.append(f"over {timeout:.0f} s")
        proc.kill()
      time.sleep(0.5)

  t = threading.Thread(target=watch, daemon=True)
  t0 = time.time()
  t.start()
  out = proc.stdout.read()
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = status
  t.join()
  row = dict(spec)
  lines = [l for l in out.splitlines() if l.startswith("{")]
  if lines:
    row.update(json.loads(lines[-1]))
  row["wall_s"] = round(time.time() - t0, 1)
  row["peak_rss_gb"] = round(usage.ru_maxrss / 2 ** 20, 2)       # ru_maxrss is in KiB
  if killed:
    row["killed"] = killed[0]
  elif status:
    row["failed"] = f"exit status {status}"
  return row


COLUMNS = ("units", "seq_split", "remat", "global_batch", "hlo_chars", "all_to_all",
           "all_gather", "collective_permute", "while", "lower_s", "compile_s",
           "peak_rss_gb", "per_chip_gib")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--one", help=argparse.SUPPRESS)
  ap.add_argument("--units", default="2,6")
  ap.add_argument("--seq_splits", default="1,2,4")
  ap.add_argument("--remat", default="block")
  ap.add_argument("--seq_len", type=int, default=8192)
  ap.add_argument("--full", action="store_true", help="also the full k3 (22 units)")
  ap.add_argument("--num_slices", type=int, default=1)
  ap.add_argument("--grad_accum", type=int, default=1)
  ap.add_argument("--global_batch", type=int, default=None,
                  help="sequences per step (default 2048 / seq_split x num_slices)")
  ap.add_argument("--limit_gb", type=float, default=14.0)
  ap.add_argument("--timeout", type=float, default=1200.0)
  ap.add_argument("--json")
  a = ap.parse_args()
  if a.one:
    spec = json.loads(a.one)
    print(json.dumps(one(spec["units"], spec["seq_split"], spec["remat"],
                         spec.get("batch"), spec["seq_len"], spec.get("extra", {}))),
          flush=True)
    return
  units = [int(u) for u in a.units.split(",") if u] + ([0] if a.full else [])
  rows = []
  print(" | ".join(COLUMNS))
  for u in units:
    for s in (int(x) for x in a.seq_splits.split(",")):
      spec = {"units": u, "seq_split": s, "remat": a.remat, "seq_len": a.seq_len,
              "batch": a.global_batch,
              "extra": {"ep_capacity": 1.25, "num_slices": a.num_slices,
                        "grad_accum": a.grad_accum}}
      row = run_child(spec, a.limit_gb, a.timeout)
      rows.append(row)
      print(" | ".join(str(row.get(c, "-")) for c in COLUMNS)
            + (f"  ({row.get('killed') or row.get('failed')})"
               if row.get("killed") or row.get("failed") else ""), flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
