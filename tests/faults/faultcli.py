"""Helpers for the fault tests: run main.py in subprocesses, hold a run at a step for a
signal, read metrics.jsonl, checksum a workdir. Fixtures are in conftest.py."""

import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 6
MODEL = ("--config=k3_tiny", "--override=num_layers=2", "--override=mla_layers=2",
         "--override=dense_layers=1")
RUN = (*MODEL, f"--steps={STEPS}", "--batch_size=2", "--seq_len=32", "--checkpoint_every=2",
       "--eval_every=100", "--optimizer=adamw")


def _cmd(args):
  return [sys.executable, os.path.join(ROOT, "main.py"), *args]


def main(env, *args, timeout=900, **extra):
  return subprocess.run(_cmd(args), cwd=ROOT, env=dict(env, **extra), capture_output=True,
                        text=True, timeout=timeout)


class Held:
  """A training run held after a step by the test hook, to be signalled."""

  def __init__(self, env, args, step, **extra):
    self.proc = subprocess.Popen(_cmd(args), cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True,
                                 env=dict(env, K3_TEST_HOLD_AFTER_STEP=str(step), **extra))
    self.lines = queue.Queue()
    self.out = []
    threading.Thread(target=self._pump, daemon=True).start()

  def _pump(self):
    for line in self.proc.stdout:
      self.lines.put(line)

  def wait_for(self, text, timeout=900):
    while True:
      line = self.lines.get(timeout=timeout)
      self.out.append(line)
      if text in line:
        return

  def finish(self, timeout=300):
    rc = self.proc.wait(timeout=timeout)
    while True:
      try:
        self.out.append(self.lines.get(timeout=5))
      except queue.Empty:
        break
    return rc, "".join(self.out)


def metrics(wd):
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]       # strict: json.loads would accept NaN,
                                                   # so validity is asserted separately


def losses(wd):
  return {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics(wd)}


def signal_at_step_3(env, wd, sig, name):
  """Runs train in `wd`, sends `sig` while it holds after step 3, and checks the run saved
  step 3 and exited 0 without a traceback; returns its output."""
  held = Held(env, ("train", *RUN, f"--workdir={wd}"), step=3)
  held.wait_for("test hook: holding after step 3")
  held.proc.send_signal(sig)
  rc, out = held.finish()
  assert rc == 0, out[-3000:]
  assert f"{name}: saved step 3" in out and "Traceback" not in out
  return out


def resume_matches(env, wd, reference, step):
  """Resumes train in `wd` and checks it started from `step` (any step when None), wrote one
  metrics line per step across the resume, and every loss equals the uninterrupted run's."""
  r = main(env, "train", *RUN, f"--workdir={wd}")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "Traceback" not in r.stdout + r.stderr
  assert f"resumed from step {'' if step is None else step}" in r.stdout
  assert [m["step"] for m in metrics(wd)] == list(range(1, STEPS + 1))
  assert losses(wd) == losses(reference)
  return r


def checksums(wd):
  out = {}
  for dirpath, _, files in os.walk(wd):
    for name in files:
      p = os.path.join(dirpath, name)
      with open(p, "rb") as f:
        out[os.path.relpath(p, wd)] = hashlib.sha256(f.read()).hexdigest()
  return out


def copy_run(src, dst):
  shutil.copytree(src, dst)
  return str(dst)


