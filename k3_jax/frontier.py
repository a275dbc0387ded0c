"""The serving frontier of a pod: `compile --step=decode|prefill --sweep=...` over a grid of
operating points (batch x context), each compiled ahead of time on the layout that suits it
(k3_jax/compile.py: the page split and the expert exchange follow the batch) and read by
the roofline; then a table of them and the frontier (tokens/s for the node against the
time per output token) as text, JSON lines and a plot.

A point whose arguments alone cannot fit (every chip's share of the served weights and of
the cache, the least it must hold) is reported as not fitting without compiling it. The
sweep appends each point to `--sweep_out` as it finishes and skips points already there,
so a long grid can be run in pieces.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import time

import jax

from k3_jax.config import ConfigError
from sharding import arrays

_SUFFIX = {"": 1, "K": 1024, "M": 1024 ** 2}
SWEEP_AXES = ("batch", "cache_len", "piece")   # piece: prefill only


def parse_count(text: str) -> int:
  """'8', '32K', '1M' (powers of 1024, either case) -> int."""
  m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
  if not m or int(m.group(1)) < 1:
    raise ConfigError(f"sweep value {text!r}: expected a positive integer with an optional "
                      f"K or M suffix (32K = 32768)")
  return int(m.group(1)) * _SUFFIX[m.group(2).upper()]


def parse_sweep(spec: str) -> dict[str, list[int]]:
  """'batch:8,64;cache_len:8K,1M' -> {"batch": [8, 64], "cache_len": [8192, 1048576]}.
  An axis not given takes the single value of its flag (the caller's default). piece
  (prefill): the tokens of each prompt one step takes (the engine's prefill chunk), the
  prompt being cache_len long; without it the whole prompt in one step."""
  grid: dict[str, list[int]] = {}
  for part in filter(None, (p.strip() for p in spec.split(";"))):
    name, colon, values = part.partition(":")
    name = name.strip()
    if not colon or name not in SWEEP_AXES:
      raise ConfigError(f"--sweep part {part!r}: expected AXIS:V1,V2,... with AXIS one of "
                        f"{', '.join(SWEEP_AXES)}")
    if name in grid:
      raise ConfigError(f"--sweep names {name} twice")
    grid[name] = [parse_count(v) for v in values.split(",") if v.strip()]
    if not grid[name]:
      raise ConfigError(f"--sweep {name}: no values")
  if not grid:
    raise ConfigError("--sweep is empty; e.g. --sweep='batch:8,64;cache_len:32K,1M'")
  return grid


def points(grid: dict[str, list[int]], batch: int | None, cache_len: int | None):
  """The grid's (batch, cache_len) points, batch outermost."""
  bs = grid.get("batch") or [batch]
  ls = grid.get("cache_len") or [cache_len]
  if None in bs or None in ls:
    raise ConfigError("--sweep needs batch and cache_len values (in the sweep or as "
                      "--global_batch / --cache_len)")
  return [(b, n) for b in bs for n in ls]


def least_bytes_per_chip(cfg, step: str, batch: int, length: int, chips: int,
                         expert_format: str) -> float:
  """What every chip must hold at least: its share of the served weights and of the cache
  (decode: the paged cache of `batch` x `length`; prefill: the filled cache)."""
  from k3_jax import compile as comp
  from k3_jax.model import create_model
  weights = comp.served_weight_bytes(cfg, expert_format).total
  cache = jax.eval_shape(lambda: create_model(cfg, mode="abstract").init_cache(batch, length))
  return (weights + arrays.tree_bytes(cache)) / chips


def point_summary(rep: dict) -> dict:
  """The numbers of one compiled point the table and the plot read."""
  r = rep.get("roofline") or {}
  step, batch = rep["step"], rep["global_batch"]
  out = {"step": step, "batch": batch, "cache_len": rep.get("cache_len"),
         "mesh": ",".join(f"{k}:{v}" for k, v in rep["mesh"].items() if v != 1),
         "page_split": rep.get("page_split"), "expert_exchange": rep.get("expert_exchange"),
         "token_groups": rep.get("token_groups"), "ep_capacity": rep.get("ep_capacity"),
         "ep_recv_capacity": rep.get("ep_recv_capacity"), "fits": rep["fits"],
         "gib_per_chip": rep["per_chip_total_bytes"] / 2 ** 30,
         "compile_seconds": rep.get("compile_seconds")}
  if rep.get("skipped"):
    out["skipped"] = rep["skipped"]
  if "step_time_s" in r:
    out.update(hbm_bytes_per_chip=r["hbm_bytes_per_chip"], bound=r["bound"],
               step_time_s=r["step_time_s"], seconds=r["seconds"],
               tokens_per_s=r["tokens_per_s"], flops_per_chip=r["flops_per_chip"],
               ici_wire_bytes_per_chip=r["ici_wire_bytes_per_chip"], mfu=r.get("mfu"))
    if step == "decode":
      out["tpot_s"] = r["step_time_s"]              # one token per sequence a step
      out["min_bytes_per_chip"] = r.get("analytic_min_bytes_per_chip")
      out["hbm_vs_min"] = r.get("hbm_bytes_vs_min")
      m = r.get("at_min_routing")
      if m:
        out["at_min_routing"] = {"hbm_vs_min": m["hbm_bytes_vs_min"],
                                 "tokens_per_s": m["tokens_per_s"],
                                 "step_time_s": m["step_time_s"]}
    else:
      out["ttft_s"] = r["step_time_s"]              # the whole prompt in one step
  return out


def run_sweep(cfg, tc, target, step: str, kw: dict, grid: dict[str, list[int]],
              out_path: str | None = None, page_split: str = "auto", log=print) -> list[dict]:
  """Compile every point of `grid` (decode or prefill) with compile_step and kw (its
  keyword arguments from the preset's layout and the flags); -> the points' summaries in
  grid order. Points already in out_path (JSON lines) are read, not compiled again."""
  from k3_jax import compile as comp
  if step not in ("decode", "prefill"):
    raise ConfigError(f"--sweep is for --step=decode or prefill, not {step}")
  if "piece" in grid and step != "prefill":
    raise ConfigError("--sweep piece: is for --step=prefill (the tokens of a prompt a step)")
  done = {}
  if out_path and os.path.exists(out_path):
    with open(out_path) as f:
      for line in f:
        p = json.loads(line)
        done[(p["step"], p["batch"], p["cache_len"], p.get("piece"))] = p
  results = []
  grid_points = [(b, n, piece) for b, n in points(grid, kw.get("global_batch"),
                                                  kw.get("cache_len"))
                 for piece in grid.get("piece") or [None]]
  for batch, length, piece in grid_points:
    key = (step, batch, length, piece)
    if key in done:
      results.append(done[key])
      continue
    least = least_bytes_per_chip(cfg, step, batch, length, target.chips, kw["expert_format"])
    t0 = time.time()
    if least > target.chip_hbm_bytes:
      rep = {"step": step, "global_batch": batch, "cache_len": length,
             "mesh": {}, "fits": False, "per_chip_total_bytes": least,
             "skipped": "the weights' and cache's shares alone exceed the chip's HBM"}
    else:
      args = dict(kw, global_batch=batch, cache_len=length)
      if step == "prefill":
        args["seq_len"] = piece or length
      else:
        args["page_split"] = page_split
      try:
        rep = comp.compile_step(cfg, tc, target, step, **args)
      except ConfigError as e:
        rep = {"step": step, "global_batch": batch, "cache_len": length, "mesh": {},
               "fits": False, "per_chip_total_bytes": 0, "skipped": str(e)}
    p = point_summary(rep)
    if piece:
      p["piece"] = piece
      if "ttft_s" in p:                 # every piece's step gathers the prompt's whole table
        p["ttft_s"] = p["step_time_s"] * -(-length // piece)
    p["wall_seconds"] = round(time.time() - t0, 1)
    results.append(p)
    log(point_line(p))
    if out_path:
      with open(out_path, "a") as f:
        f.write(json.dumps(p) + "\n")
    jax.clear_caches()
    gc.collect()
  return results


def frontier(pts: list[dict]) -> list[dict]:
  """Decode points no other point beats on both node tokens/s and TPOT (for one context
  length: the curve a node traces by choosing its batch), in TPOT order."""
  ok = [p for p in pts if p.get("tokens_per_s") and p["fits"]]
  out = [p for p in ok if not any(
      q is not p and q["cache_len"] == p["cache_len"] and q["tokens_per_s"] >= p["tokens_per_s"]
      and q["step_time_s"] <= p["step_time_s"]
      and (q["tokens_per_s"], -q["step_time_s"]) != (p["tokens_per_s"], -p["step_time_s"])
      for q in ok)]
  return sorted(out, key=lambda p: (p["cache_len"], p["step_time_s"]))


def _len(n: int) -> str:
  return f"{n // 2 ** 20}M" if n % 2 ** 20 == 0 else (f"{n // 1024}K" if n % 1024 == 0 else str(n))


def _piece(p: dict) -> str:
  return f" ({_len(p['piece'])} a step)" if p.get("piece") else ""


def point_line(p: dict) -> str:
  """One point as a line of text."""
  head = f"{p['step']} {p['batch']} x {_len(p['cache_len'])}" + _piece(p)
  if p.get("skipped"):
    return f"{head}: not compiled, {p['skipped']} ({p['gib_per_chip']:.1f} GiB per chip)"
  fit = f"{'fits' if p['fits'] else 'DOES NOT FIT'} {p['gib_per_chip']:.2f} GiB"
  if "step_time_s" not in p:
    return f"{head}: {fit}"
  groups = (f", tokens in {p['token_groups']} groups" if (p.get("token_groups") or 1) > 1
            else "")
  s = (f"{head} [{p['mesh']}, pages {p.get('page_split')}, experts "
       f"{p.get('expert_exchange')}{groups}]: {fit}, {p['hbm_bytes_per_chip'] / 1e9:.1f} GB HBM")
  if p.get("hbm_vs_min"):
    s += f" ({p['hbm_vs_min']:.2f}x min)"
  s += f", {p['bound']}-bound, step {p['step_time_s'] * 1e3:.1f} ms, "
  s += f"{p['tokens_per_s']:,.0f} tok/s node"
  if p["step"] == "prefill" and p.get("mfu") is not None:
    s += f", MFU {100 * p['mfu']:.1f}%"
  if p.get("piece") and p.get("ttft_s"):
    s += f", TTFT {p['ttft_s'] * 1e3:,.0f} ms"
  return s


def markdown_table(pts: list[dict]) -> str:
  """The points as a markdown table (decode: TPOT and tokens/s; prefill: TTFT and MFU);
  decode points on their context length's frontier are marked."""
  front = {id(p) for p in frontier(pts)}
  rows = ["| step | batch x context | layout (pages, experts) | GiB/chip | HBM GB/chip (x min) "
          "| bound | step ms (TPOT / TTFT) | node tok/s | MFU | frontier |",
          "|---|---|---|---|---|---|---|---|---|---|"]
  for p in pts:
    what = f"{p['batch']:,} x {_len(p['cache_len'])}" + _piece(p)
    if p.get("skipped") or "step_time_s" not in p:
      why = p.get("skipped", "no roofline")
      rows.append(f"| {p['step']} | {what} | - | {p['gib_per_chip']:.1f} (does not fit) "
                  f"| - | - | - | - | - | {why} |")
      continue
    ratio = f" ({p['hbm_vs_min']:.2f}x)" if p.get("hbm_vs_min") else ""
    lay = (f"{p.get('page_split')}, {p.get('expert_exchange')}" if p["step"] == "decode"
           else p["mesh"])
    if (p.get("token_groups") or 1) > 1:
      lay += f", {p['token_groups']} token groups"
    mfu = f"{100 * p['mfu']:.1f}%" if p.get("mfu") is not None else "-"
    rows.append(f"| {p['step']} | {what} | {lay} | {p['gib_per_chip']:.1f}"
                f"{'' if p['fits'] else ' (does not fit)'} | "
                f"{p['hbm_bytes_per_chip'] / 1e9:.1f}{ratio} | {p['bound']} | "
                f"{p['step_time_s'] * 1e3:.1f} | {p['tokens_per_s']:,.0f} | {mfu} | "
                f"{'yes' if id(p) in front else ''} |")
  return "\n".join(rows)


def plot(pts: list[dict], path: str, title: str,
         targets: tuple[tuple[float, float, str], ...] = ()) -> None:
  """Node tokens/s against TPOT, one line per context length; targets: (TPOT s, tokens/s,
  label) marked as stars."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  dec = [p for p in pts if p["step"] == "decode" and p.get("tokens_per_s") and p["fits"]]
  for length in sorted({p["cache_len"] for p in dec}):
    mine = sorted((p for p in dec if p["cache_len"] == length), key=lambda p: p["step_time_s"])
    xs = [p["step_time_s"] * 1e3 for p in mine]
    ys = [p["tokens_per_s"] for p in mine]
    line, = ax.plot(xs, ys, "o-", label=f"context {_len(length)}")
    for p, x, y in zip(mine, xs, ys):
      ax.annotate(f"{p['batch']}", (x, y), textcoords="offset points", xytext=(4, 4),
                  fontsize=8, color=line.get_color())
  for tpot, rate, label in targets:
    ax.plot([tpot * 1e3], [rate], "k*", markersize=10)
    ax.annotate(label, (tpot * 1e3, rate), textcoords="offset points", xytext=(6, -10),
                fontsize=8)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("TPOT (ms, roofline step time)")
  ax.set_ylabel("output tokens/s for the node")
  ax.set_title(title, fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


__all__ = ["SWEEP_AXES", "parse_count", "parse_sweep", "points", "least_bytes_per_chip",
           "point_summary", "run_sweep", "frontier", "point_line", "markdown_table", "plot"]
