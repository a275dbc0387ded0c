"""Damaged-checkpoint survey: for EACH file of the newest checkpoint step, damage it one way
(truncate to half, zero-fill, delete), run both restores with fallback (inference: params
only, read-only; training: the whole state, moving the bad step aside) in a fresh process,
and record what happened and whether anything besides our one-line reports reached stderr.

  python -m benchmarks.ckpt_damage [--workdir=/tmp/ckpt_damage] [--only=SUBSTRING]

It trains the trimmed k3_tiny of tests/faults (6 steps, checkpoints 2, 4, 6) once, then
works on copies. Prints a table: file, pattern, step used by each restore, stderr lines
that are not ours (the "noise"), exit code. docs/faults.md holds the results.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ("--config=k3_tiny", "--override=num_layers=2", "--override=mla_layers=2",
         "--override=dense_layers=1")
RUN = (*MODEL, "--steps=6", "--batch_size=2", "--seq_len=32", "--checkpoint_every=2",
       "--eval_every=100", "--optimizer=adamw")
PATTERNS = ("truncate", "zero", "delete")

def restore_both(wd: str, mesh, log) -> dict:
  """Both restores with fallback of workdir `wd`, in this process: inference (parameters
  only, read-only), then training (the whole state; moves an unusable newest step aside).
  {"infer": step used, "train": step used}; the one-line reports go to `log`."""
  import json
  from k3_jax.checkpoint.inference import load_for_inference
  from k3_jax.checkpoint.manager import CheckpointManager, saved_config
  from k3_jax.config import TrainConfig
  from k3_jax.train import build_steps
  out = {"infer": load_for_inference(wd, mesh, log=log).step}
  cfg = saved_config(wd)
  with open(os.path.join(wd, "train_config.json")) as f:
    tc = TrainConfig(**json.load(f))
  steps = build_steps(cfg, tc, mesh)
  ckpt = CheckpointManager(wd, cfg, keep=tc.keep_checkpoints)
  state, _ = ckpt.restore_for_training(steps.abstract_state, steps.state_shardings, log=log)
  ckpt.close()
  out["train"] = int(state["step"])
  return out


# The child process of the survey: restore_both on each workdir given.
CHILD = r"""
import sys
from benchmarks.ckpt_damage import restore_both
from sharding.mesh import make_mesh, parse_mesh
mesh = make_mesh(parse_mesh(""))
for wd in sys.argv[1:]:
  print("CASE", wd, flush=True)
  got = restore_both(wd, mesh, lambda m: print("LOG", m, flush=True))
  print("INFER", got["infer"], flush=True)
  print("TRAIN", got["train"], flush=True)
"""


def restore_damaged(workdirs: list[str], env: dict | None = None) -> tuple[list[dict], str]:
  """Runs both restores (inference, then training) of each workdir in one fresh process:
  ([{"infer": step, "train": step, "reports": [our one-line reports]}] per workdir, the
  process's whole stderr). Raises if the process fails."""
  env = dict(env or os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-c", CHILD, *workdirs], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=900)
  if r.returncode:
    raise RuntimeError(f"restore child failed (rc {r.returncode}): {r.stderr[-3000:]}")
  out = []
  for line in r.stdout.splitlines():
    key, _, rest = line.partition(" ")
    if key == "CASE":
      out.append({"infer": None, "train": None, "reports": []})
    elif key in ("INFER", "TRAIN"):
      out[-1][key.lower()] = int(rest)
    elif key == "LOG":
      out[-1]["reports"].append(rest)
  return out, r.stderr


def damage(path: str, how: str) -> None:
  if how == "delete":
    os.remove(path)
  elif how == "truncate":
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  elif how == "zero":
    n = os.path.getsize(path)
    with open(path, "r+b") as f:
      f.write(b"\0" * n)
  else:
    raise ValueError(how)


def survey(ref: str, only: str = "", step: str = "6") -> list[dict]:
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  stepdir = os.path.join(ref, "checkpoints", step)
  files = sorted(os.path.relpath(os.path.join(d, n), stepdir)
                 for d, _, ns in os.walk(stepdir) for n in ns)
  rows = []
  for rel in files:
    if only and only not in rel:
      continue
    for how in PATTERNS:
      with tempfile.TemporaryDirectory() as tmp:
        wd = os.path.join(tmp, "run")
        shutil.copytree(ref, wd)
        damage(os.path.join(wd, "checkpoints", step, rel), how)
        try:
          (got,), err = restore_damaged([wd], env)
          rc = 0
        except RuntimeError as e:
          got, err, rc = {"infer": "-", "train": "-", "reports": []}, str(e), 1
      noise = [l for l in err.splitlines() if l.strip()]
      rows.append({"file": rel, "how": how, "infer": got["infer"], "train": got["train"],
                   "reports": len(got["reports"]), "rc": rc, "noise": noise})
      print(f"{rel:58s} {how:8s} infer {got['infer']!s:>2} train {got['train']!s:>2} "
            f"reports {len(got['reports'])} rc {rc} noise {len(noise):3d} "
            f"{(noise[0][:70] if noise else '')}", flush=True)
  return rows


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "ckpt_damage"))
  p.add_argument("--only", default="")
  a = p.parse_args()
  ref = os.path.join(a.workdir, "ref")
  if not os.path.isdir(os.path.join(ref, "checkpoints", "6")):
    shutil.rmtree(ref, ignore_errors=True)
    subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), "train", *RUN,
                    f"--workdir={ref}"], cwd=ROOT, check=True, capture_output=True,
                   env=dict(os.environ, JAX_PLATFORMS="cpu"))
  rows = survey(ref, a.only)
  noisy = [r for r in rows if r["noise"]]
  failed = [r for r in rows if r["rc"] != 0]
  print(f"{len(rows)} cases: {len(noisy)} with stderr noise, {len(failed)} failed")

if __name__ == "__main__":
  main()
