"""Fault tolerance, the heavier scenarios (pytest -m slow): Ctrl-C once and twice, kill -9
with a save in flight, a signal during a fresh job's setup, the divergence reproduction, and
generate on a tiktoken-trained workdir. Same setup and
tolerances as test_faults.py (resumes bit for bit on CPU)."""

import json
import os
import signal
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from faultcli import (MODEL, RUN, Held, losses, main, metrics, resume_matches,
                      signal_at_step_3)

pytestmark = pytest.mark.slow


def tmp_dirs(wd):
  return [n for n in os.listdir(os.path.join(wd, "checkpoints")) if "tmp" in n]


def test_sigint_mid_run_saves_then_resume_matches_uninterrupted(env, reference, tmp_path):
  wd = str(tmp_path / "run")
  out = signal_at_step_3(env, wd, signal.SIGINT, "SIGINT")
  assert "KeyboardInterrupt" not in out and "cannot schedule" not in out
  resume_matches(env, wd, reference, 3)


def test_second_sigint_aborts_at_once_and_resume_is_clean(env, reference, tmp_path):
  wd = str(tmp_path / "run")
  # the hook holds after step 3 until a second signal: the first only requests a stop
  held = Held(env, ("train", *RUN, f"--workdir={wd}"), step=3, K3_TEST_HOLD_SIGNALS="2")
  held.wait_for("test hook: holding after step 3")
  # the async save of step 2 commits in the background while the run holds; wait for it,
  # as an abort would discard it (that is what the abort is for)
  committed = os.path.join(wd, "checkpoints", "2", "commit_success.txt")
  deadline = time.time() + 300
  while not os.path.exists(committed) and time.time() < deadline:
    time.sleep(0.05)
  assert os.path.exists(committed)
  held.proc.send_signal(signal.SIGINT)
  held.wait_for("SIGINT received")
  held.proc.send_signal(signal.SIGINT)
  rc, out = held.finish()
  assert rc == 130, out[-3000:]
  assert "aborted without saving" in out and "Traceback" not in out
  assert not os.path.exists(os.path.join(wd, "checkpoints", "3"))       # nothing saved
  resume_matches(env, wd, reference, 2)


def test_signal_during_setup_is_deferred_to_the_first_step(env, reference, tmp_path):
  """SIGTERM while the job is still setting up (held by the test hook before anything is
  written; compilation comes later): the handler is already installed, so the first step
  is trained, saved and the job exits 0 with one line, no traceback, no half-made workdir."""
  wd = str(tmp_path / "run")
  held = Held(env, ("train", *RUN, f"--workdir={wd}"), step=0)
  held.wait_for("test hook: holding after step 0")
  assert not os.path.exists(wd)                # still in setup: nothing written yet
  held.proc.send_signal(signal.SIGTERM)
  rc, out = held.finish()
  assert rc == 0, out[-3000:]
  assert "SIGTERM: saved step 1" in out and "Traceback" not in out, out[-3000:]
  ckdir = os.path.join(wd, "checkpoints")
  assert sorted(os.listdir(ckdir)) == ["1", "model_config.json"]       # no tmp directory
  assert os.path.exists(os.path.join(ckdir, "1", "k3_integrity.json"))  # complete, sealed
  assert losses(wd) == {1: losses(reference)[1]}       # bit for bit the reference's step 1


def test_kill_9_with_a_save_in_flight_then_resume(env, reference, tmp_path):
  wd = str(tmp_path / "run")
  r = main(env, "train", *RUN, f"--workdir={wd}", K3_TEST_SIGKILL_IN_SAVE="4")
  assert r.returncode == -signal.SIGKILL
  steps = sorted(int(n) for n in os.listdir(os.path.join(wd, "checkpoints")) if n.isdigit())
  assert 2 in steps                         # the previous checkpoint is intact
  resume_matches(env, wd, reference, None)
  assert not tmp_dirs(wd)                   # an unfinished save is discarded


def _all_finite(step_dir):
  tree = ocp.StandardCheckpointer().restore(os.path.join(step_dir, "state"))
  import jax
  return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree)
             if np.issubdtype(np.asarray(x).dtype, np.inexact))


def test_divergence_keeps_finite_checkpoints_stops_and_resumes(env, tmp_path):
  """The reproduction of issue 16 at test size: AdamW at lr 1e6 diverges; no non-finite
  state is checkpointed, the run stops with a clear message, and the same command at a
  sane lr resumes from the last finite checkpoint."""
  wd = str(tmp_path / "nan")
  run = (*MODEL, "--steps=10", "--batch_size=2", "--seq_len=32", "--eval_every=100",
         "--optimizer=adamw", "--checkpoint_every=1", "--max_bad_steps=2")
  r = main(env, "train", *run, "--learning_rate=1e6", f"--workdir={wd}")
  assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
  assert "training diverged" in r.stderr and "holds finite parameters" in r.stderr
  assert "Traceback" not in r.stderr
  recs = metrics(wd)
  skipped = [m for m in recs if m.get("skipped")]
  assert len(skipped) >= 2 and all(m["skipped_steps"] >= 1 for m in skipped)
  ckdir = os.path.join(wd, "checkpoints")
  steps = sorted(int(n) for n in os.listdir(ckdir) if n.isdigit())
  assert steps and max(steps) < skipped[0]["step"]      # none written inside the streak
  assert all(_all_finite(os.path.join(ckdir, str(s))) for s in steps)
  r = main(env, "train", *run, "--learning_rate=1e-3", "--max_bad_steps=10", f"--workdir={wd}")
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  assert f"resumed from step {max(steps)}" in r.stdout
  recs = metrics(wd)
  assert [m["step"] for m in recs] == list(range(1, 11))   # one line per step
  after = [m for m in recs if m["step"] > max(steps)]
  assert after and all(m["loss"] is not None and np.isfinite(m["loss"]) for m in after)
  # skipped_steps carries across the resume: the skipped steps kept before it (those past
  # the resumed checkpoint were dropped and retrained)
  kept_skipped = sum(bool(m.get("skipped")) for m in recs if m["step"] <= max(steps))
  assert all(m.get("skipped_steps", 0) == kept_skipped for m in after)
  r = main(env, "generate", f"--workdir={wd}", "--prompt=def ", "--max_new_tokens=4")
  assert r.returncode == 0 and r.stdout.startswith("def "), r.stderr[-3000:]


def test_generate_uses_the_workdir_tokenizer(env, tmp_path):
  import base64
  merges = [b"de", b"def", b"def ", b"re", b"ret", b"return", b"  ", b"    ", b"in", b"se",
            b"self", b"or", b"for", b"im", b"import"]
  tokens = [bytes([i]) for i in range(256)] + merges
  bpe = tmp_path / "tiny.tiktoken"
  bpe.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n"
                         for rank, t in enumerate(tokens)))
  data = tmp_path / "data.jsonl"
  with open(data, "w") as f:
    for i in range(8):
      f.write(json.dumps({"text": f"def f{i}(self):\n    for x in self:\n        return x\n"})
              + "\n")
  wd = str(tmp_path / "run")
  run = (*MODEL, "--override=vocab_size=288", "--steps=2", "--batch_size=2", "--seq_len=32",
         "--eval_every=100", "--optimizer=adamw", f"--tokenizer={bpe}", f"--dataset={data}")
  r = main(env, "train", *run, f"--workdir={wd}")
  assert r.returncode == 0, r.stderr[-3000:]
  implicit = main(env, "generate", f"--workdir={wd}", "--prompt=def ", "--max_new_tokens=12")
  assert implicit.returncode == 0, implicit.stderr[-3000:]
  explicit = main(env, "generate", f"--workdir={wd}", "--prompt=def ", "--max_new_tokens=12",
                  f"--tokenizer={bpe}")
  assert explicit.returncode == 0, explicit.stderr[-3000:]
  assert implicit.stdout == explicit.stdout and implicit.stdout.startswith("def ")
