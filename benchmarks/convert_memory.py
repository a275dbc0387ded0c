"""Peak host memory (RSS) and time of `convert` import and export, against the model size.

    python -m benchmarks.convert_memory [--config=k3_small] [--override=moe.num_experts=128]
                                        [--max_shard_size=50MB]

Writes a random model of the config as a Hugging Face directory (variable by variable, never
the whole model), then runs in fresh processes, one at a time: a bare process that imports
what `convert` imports (the floor), the import (safetensors -> Orbax step-0 train state) and
the export (Orbax -> safetensors; dense experts, then MXFP4 where the widths allow). Each
child reports its own peak RSS (VmHWM). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _peak_gb() -> float:
  """This process's peak RSS: VmHWM of /proc/self/status (its own address space's high-water
  mark). Not ru_maxrss: Linux carries the parent's peak into a child across fork + exec, so
  every child would report at least the parent's size (the parent wrote the model)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024 / 1e9                       # kB
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9   # KiB on Linux


def child(kind: str, src: str, dst: str, expert_format: str) -> None:
  from k3_jax.checkpoint import convert
  t0 = time.time()
  if kind == "import":
    convert.import_to_workdir(src, dst)
  elif kind == "export":
    convert.export_workdir(src, dst, expert_format=expert_format)
  else:                                     # the floor: what the jobs import, one jax op
    import jax.numpy as jnp
    from k3_jax import train  # noqa: F401
    from k3_jax.checkpoint import manager  # noqa: F401
    jnp.zeros(1).block_until_ready()
  print(json.dumps({"peak_rss_gb": _peak_gb(), "seconds": time.time() - t0}))


def random_value(cfg, seed: int = 0):
  """path -> a random value of that model variable (scale 0.02), the same for the same path
  and seed whenever asked: a model that is never held whole."""
  import zlib
  import numpy as np
  from k3_jax.checkpoint.layouts.common import variable_shapes
  shapes = variable_shapes(cfg)

  last: dict = {}

  def value(path):
    if path not in last:           # an export asks once per expert, w1 / w2 / w3 in turn:
      shape, dtype = shapes[path]  # keep the last three variables
      rng = np.random.default_rng([seed, zlib.crc32(repr(path).encode())])
      if len(last) >= 3:
        last.pop(next(iter(last)))
      last[path] = (rng.standard_normal(shape, np.float32) * 0.02).astype(dtype)
    return last[path]

  return value


def write_random_hf(cfg, out_dir: str, max_shard_size: str, seed: int = 0) -> int:
  """A random model of cfg (random_value) as safetensors, written variable by variable;
  returns its bytes."""
  from k3_jax.checkpoint import convert
  out = convert.export_state(cfg, random_value(cfg, seed), out_dir,
                             max_shard_size=max_shard_size, expert_format="dense")
  return out["total_bytes"]


def _run(args: list[str]) -> dict:
  r = subprocess.run([sys.executable, "-m", "benchmarks.convert_memory", *args],
                     capture_output=True, text=True)
  if r.returncode:
    raise RuntimeError(r.stderr[-3000:])
  return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="k3_small")
  ap.add_argument("--override", action="append", default=None)
  ap.add_argument("--max_shard_size", default="50MB")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--src", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--dst", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--expert_format", default="dense", help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.child:
    child(a.child, a.src, a.dst, a.expert_format)
    return
  import configs
  from k3_jax.config import apply_overrides
  overrides = ["moe.num_experts=128"] if a.override is None else a.override
  cfg = apply_overrides(configs.get(a.config), overrides)
  rows = {}
  with tempfile.TemporaryDirectory() as tmp:
    hf, wd = os.path.join(tmp, "hf"), os.path.join(tmp, "work")
    model_bytes = write_random_hf(cfg, hf, a.max_shard_size)
    rows["bare process"] = _run(["--child=bare", f"--src={hf}", f"--dst={wd}"])
    rows["import"] = _run(["--child=import", f"--src={hf}", f"--dst={wd}"])
    rows["export (dense experts)"] = _run(["--child=export", f"--src={wd}",
                                           f"--dst={os.path.join(tmp, 'e1')}"])
    try:
      rows["export (MXFP4 experts)"] = _run(["--child=export", f"--src={wd}",
                                             f"--dst={os.path.join(tmp, 'e2')}",
                                             "--expert_format=mxfp4"])
    except RuntimeError:
      pass                                  # widths MXFP4 cannot hold
  gb = model_bytes / 1e9
  print(f"{cfg.name} {' '.join(overrides)}: {gb:.3f} GB of parameters, shards of "
        f"{a.max_shard_size}")
  print(f"{'':<24} {'peak RSS GB':>12} {'- bare':>8} {'/ model':>8} {'seconds':>8}")
  floor = rows["bare process"]["peak_rss_gb"]
  for k, r in rows.items():
    over = r["peak_rss_gb"] - floor
    print(f"{k:<24} {r['peak_rss_gb']:>12.3f} {over:>8.3f} {over / gb:>8.2f} "
          f"{r['seconds']:>8.1f}")
  res = {"config": cfg.name, "overrides": overrides, "model_gb": gb,
         "max_shard_size": a.max_shard_size, "rows": rows}
  print(json.dumps(res))


if __name__ == "__main__":
  main()
