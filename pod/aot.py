"""Ahead-of-time compilation for TPU targets: lower a jitted step with abstract inputs,
compile it for compile-only devices, and report per-chip memory and FLOPs.

Nothing is allocated: inputs are ShapeDtypeStructs carrying their shardings
(sharding/arrays.py with_shardings), so a 2.8T parameter train step compiles for 2048
chips from a CPU machine. This module knows meshes and compiled programs only; the
`compile` command in main.py builds the step (from train or the model's prefill/decode)
and hands it here.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import jax

from pod import roofline
from pod.topology import GiB


# glibc's M_ARENA_MAX (mallopt parameter number).
_M_ARENA_MAX = -8


def limit_malloc_arenas(n: int = 2) -> bool:
  """Caps glibc malloc at n arenas for this process (unless MALLOC_ARENA_MAX is set in the
  environment, which wins). The TPU compiler (libtpu allocates with glibc malloc)
  generates code on many threads, and by default each thread contention opens another
  arena that keeps its freed memory: for a 1-unit k3 train step at sequence:4, peak host
  RSS 14.72 GiB with the default arenas, 12.85 GiB with 2 (19% more compile time).
  Call it before compiling, early in the process. Returns whether the cap was set
  (False off glibc)."""
  import ctypes
  import ctypes.util
  import os
  if "MALLOC_ARENA_MAX" in os.environ:
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return bool(libc.mallopt(_M_ARENA_MAX, int(n)))
  except (OSError, AttributeError):
    return False


def memory_numbers(compiled) -> dict:
  """Per-chip bytes of a compiled SPMD program (XLA's memory analysis of one device).

  total = arguments + outputs - outputs aliased to (donated) arguments + temporaries +
  generated code: the peak the program needs on one chip."""
  m = compiled.memory_analysis()
  out = {"argument_bytes": int(m.argument_size_in_bytes),
         "output_bytes": int(m.output_size_in_bytes),
         "alias_bytes": int(m.alias_size_in_bytes),
         "temp_bytes": int(m.temp_size_in_bytes),
         "generated_code_bytes": int(m.generated_code_size_in_bytes)}
  out["per_chip_total_bytes"] = (out["argument_bytes"] + out["output_bytes"]
                                 - out["alias_bytes"] + out["temp_bytes"]
                                 + out["generated_code_bytes"])
  return out


def flops(compiled) -> float | None:
  """FLOPs per device from XLA's cost analysis (None where the backend gives none)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost or "flops" not in cost:
    return None
  return float(cost["flops"])


def compile_report(jitted, args: tuple, chip_hbm_bytes: int, generation: str | None = None,
                   model_flops: float | None = None, scope_of=None) -> tuple[Any, dict]:
  """Lower `jitted` with abstract `args` (ShapeDtypeStructs with shardings), compile, and
  measure. -> (compiled, report dict with the memory numbers, flops, chip_hbm_bytes, fits,
  headroom_bytes, lower_seconds, compile_seconds, and with `generation` (v5e | v5p | v6e) a
  `roofline` (pod/roofline.py; model_flops: the useful FLOPs per chip, for the MFU)).
  flops_per_chip counts every loop iteration (roofline.program_costs); xla_flops_per_chip is
  XLA's cost analysis, which counts a loop body once. scope_of(op_name, opcode) -> scope:
  the roofline also gets `scopes`, the costs per scope (roofline.program_costs)."""
  t0 = time.time()
  lowered = jitted.lower(*args)
  t1 = time.time()
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    # The TPU compiler refuses a program that cannot fit in HBM; its message states the
    # memory the program needs, which is the number we report.
    need = _oom_bytes(str(e))
    if need is None:
      raise
    rep = {k: None for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                             "generated_code_bytes", "flops_per_chip")}
    rep.update(per_chip_total_bytes=need, chip_hbm_bytes=int(chip_hbm_bytes),
               headroom_bytes=int(chip_hbm_bytes) - need, fits=False,
               compiler_error=str(e).strip()[:500], lower_seconds=round(t1 - t0, 1),
               compile_seconds=round(time.time() - t1, 1))
    return None, rep
  t2 = time.time()
  rep = memory_numbers(compiled)
  text = compiled.as_text()
  if os.environ.get("K3_DUMP_HLO"):           # debugging aid: the program the roofline reads
    with open(os.environ["K3_DUMP_HLO"], "w") as f:
      f.write(text)
  costs = roofline.program_costs(text, scope_of=scope_of)
  rep["flops_per_chip"] = costs.flops
  rep["xla_flops_per_chip"] = flops(compiled)
  if generation is not None:
    rep["roofline"] = roofline.roofline(costs, generation, model_flops)
    if scope_of is not None:
      rep["roofline"]["scopes"] = costs.scopes
  rep["chip_hbm_bytes"] = int(chip_hbm_bytes)
  rep["headroom_bytes"] = int(chip_hbm_bytes) - rep["per_chip_total_bytes"]
  rep["fits"] = rep["headroom_bytes"] >= 0
  rep["lower_seconds"] = round(t1 - t0, 1)
  rep["compile_seconds"] = round(t2 - t1, 1)
  return compiled, rep


_UNITS = {"": 1, "B": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40, "P": 2 ** 50}


def _oom_bytes(msg: str) -> int | None:
  """Bytes the program needs per chip from a TPU out-of-memory compile error, e.g.
  "RESOURCE_EXHAUSTED: ... required for HLO temporaries (128.00G) exceeds available HBM
  (95.74G)" or "Used 120.5G of 95.74G hbm"; None for any other error."""
  if "RESOURCE_EXHAUSTED" not in msg and "out of memory" not in msg.lower():
    return None
  size = r"([0-9.]+)\s*([KMGTP]?)(?:i?B)?"
  m = (re.search(r"\(" + size + r"\)\s*exceeds available HBM", msg) or
       re.search(r"Used\s+" + size + r"\s+of\s+", msg))
  if not m:
    return None
  return int(float(m.group(1)) * _UNITS[m.group(2)])


def verdict(rep: dict) -> str:
  gib = lambda b: f"{b / GiB:.2f} GiB"
  total, hbm = rep["per_chip_total_bytes"], rep["chip_hbm_bytes"]
  if rep["fits"]:
    return (f"FITS: {gib(total)} of {gib(hbm)} per chip ({100 * total / hbm:.0f}%, "
            f"{gib(hbm - total)} free)")
  return f"DOES NOT FIT: {gib(total)} per chip exceeds {gib(hbm)} by {gib(total - hbm)}"


def format_report(rep: dict) -> str:
  gib = lambda b: f"{b / GiB:10.3f} GiB"
  if rep.get("compiler_error"):
    return "\n".join([f"the TPU compiler stopped: {rep['compiler_error']}",
                       f"total/chip >= {gib(rep['per_chip_total_bytes'])}   (chip HBM "
                       f"{rep['chip_hbm_bytes'] / GiB:.0f} GiB)", verdict(rep)])
  lines = [
      f"arguments     {gib(rep['argument_bytes'])}",
      f"outputs       {gib(rep['output_bytes'])}  ({rep['alias_bytes'] / GiB:.3f} GiB of them "
      f"alias donated arguments)",
      f"temporaries   {gib(rep['temp_bytes'])}",
      f"code          {gib(rep['generated_code_bytes'])}",
      f"total/chip    {gib(rep['per_chip_total_bytes'])}   (chip HBM {rep['chip_hbm_bytes'] / GiB:.0f} GiB)",
  ]
  if rep.get("flops_per_chip") is not None:
    lines.append(f"flops/chip    {rep['flops_per_chip']:.4g}")
  if rep.get("roofline"):
    lines.append(roofline.format_roofline(rep["roofline"]))
  lines.append(f"compile       {rep['lower_seconds']:.1f} s lowering + "
               f"{rep['compile_seconds']:.1f} s compiling")
  lines.append(verdict(rep))
  return "\n".join(lines)


__all__ = ["limit_malloc_arenas", "memory_numbers", "flops", "compile_report", "verdict",
           "format_report"]
