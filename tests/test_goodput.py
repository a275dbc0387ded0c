"""Observability of a training run: the goodput fields of metrics.jsonl and the summary
line (k3_jax/goodput.py), and the jax.profiler trace of `--profile_steps` (profiling.py).

The run is test_train.py's k3_tiny step (same model, train config and single-device mesh:
in one pytest process the compiled step is shared), 4 steps, the trace over steps 2-3, a
checkpoint at the end. What is checked: trace files exist and are non-empty; every
metrics line has the goodput fields, non-negative, non-decreasing from line to line,
summing to no more than the wall time, with goodput = time_steps / wall_time; compile
time is told apart from the time of the step it happens in.
"""

import dataclasses
import glob
import json
import os
import time

import jax
import jax.numpy as jnp
import pytest

import configs
from k3_jax import goodput, train
from k3_jax.checkpoint.manager import CheckpointManager
from k3_jax.config import UserError
from k3_jax.data import mqar
from k3_jax.profiling import parse_steps
from sharding.mesh import make_mesh, parse_mesh

CFG = configs.get("k3_tiny")
TC = dataclasses.replace(configs.get_train("k3_tiny"), batch_size=8, seq_len=32,
                         learning_rate=1e-2, log_every=1, checkpoint_every=4, eval_every=100)
TIMES = ("time_compile", "time_init", "time_data", "time_steps", "time_eval",
         "time_checkpoint")


def test_goodput_fields_summary_and_profile_trace(tmp_path):
  workdir = str(tmp_path / "run")
  mesh = make_mesh(parse_mesh(""), devices=jax.devices()[:1])
  lines = []
  it = mqar.mqar_dataset(TC.batch_size, TC.seq_len, CFG.vocab_size, num_kv_pairs=4, seed=5)
  last = train.run(CFG, TC, workdir, mesh, it, [], ckpt=CheckpointManager(workdir, CFG),
                   log=lines.append, profile_steps=(2, 3))
  # The trace: TensorBoard's xplane and Perfetto's json, non-empty, under <workdir>/profile.
  files = glob.glob(os.path.join(workdir, "profile", "**", "*"), recursive=True)
  xplane = [f for f in files if f.endswith(".xplane.pb")]
  perfetto = [f for f in files if f.endswith("perfetto_trace.json.gz")]
  assert xplane and perfetto, files
  assert all(os.path.getsize(f) > 0 for f in xplane + perfetto)
  assert any(l.startswith("profile of steps 2-3 written to") for l in lines), lines
  # metrics.jsonl: the goodput fields on every line, cumulative.
  recs = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  assert [r["step"] for r in recs] == [1, 2, 3, 4]
  prev = dict.fromkeys(TIMES, 0.0)
  for r in recs + [last]:
    assert all(r[k] >= prev[k] >= 0 for k in TIMES), r
    # Disjoint spans: their sum never exceeds the wall time (1e-3: rounding to 4 digits).
    assert sum(r[k] for k in TIMES) <= r["wall_time"] + 1e-3, r
    assert r["goodput"] == pytest.approx(r["time_steps"] / r["wall_time"], abs=1e-3)
    assert 0 < r["goodput"] <= 1
    prev = {k: r[k] for k in TIMES}
  assert last["time_checkpoint"] > 0 and last["time_init"] > 0
  summary = lines[-1]
  assert summary.startswith("goodput ") and "compile" in summary and "wall" in summary


def test_compile_time_is_told_apart_from_the_span_it_happens_in():
  clock = goodput.Goodput()
  f = jax.jit(lambda x: jnp.sin(x) * 3 + 1)
  with clock.span("step"):
    f(jnp.ones((7, 13))).block_until_ready()      # traced, lowered and compiled here
  first = dict(clock.seconds)
  assert first["compile"] > 0
  with clock.span("step"):
    f(jnp.ones((7, 13))).block_until_ready()      # cached: no compile
    time.sleep(0.05)
  assert clock.seconds["compile"] == first["compile"]
  assert clock.seconds["step"] >= first["step"] + 0.05
  with pytest.raises(ValueError, match="span kind"):
    with clock.span("compile"):
      pass


def test_compile_clock_counts_nested_events_once():
  c = goodput.CompileClock()
  c("/jax/core/compile/jaxpr_trace_duration", 0.01)          # an inner jit's trace ...
  c("/jax/core/compile/jaxpr_trace_duration", 10.0)          # ... inside the outer one's
  c("/jax/some/other_event", 5.0)                            # not a compile event
  assert c.seconds() == pytest.approx(10.0, abs=0.01)
  c("/jax/core/compile/backend_compile_duration", 0.001)     # after it: added
  assert c.seconds() == pytest.approx(10.001, abs=0.01)


def test_profile_steps_flag_values():
  assert parse_steps("3:5") == (3, 5) and parse_steps("") is None
  for bad in ("5:3", "0:2", "3", "a:b"):
    with pytest.raises(UserError, match="profile_steps"):
      parse_steps(bad)
