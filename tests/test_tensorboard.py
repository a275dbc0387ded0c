"""TensorBoard: the scalars of metrics.jsonl go to <workdir>/tensorboard as event files, read
back here with TensorBoard's own EventAccumulator; a resumed run's points replace those an
earlier run logged past its checkpoint."""

import dataclasses
import json
import os

import jax
import pytest

import configs
from k3_jax import summaries, train
from k3_jax.data import datasets, prepare
from sharding.mesh import make_mesh, parse_mesh


def test_writer_round_trip_and_resume_drops_later_points(tmp_path):
  d = str(tmp_path / "tb")
  w = summaries.TensorBoardWriter(d)
  for step in (1, 2, 3, 4):
    w.write({"step": step, "loss": 10.0 - step, "lr_muon": 1e-3, "skipped": True,
             "eval_loss": 7.5, "load_max_mean": 2.0, "time_steps": 0.5, "note": "x"})
  w.close()
  got = summaries.read_scalars(d)
  assert set(got) == {"train/loss", "lr/muon", "eval/loss", "moe/load_max_mean",
                      "goodput/time_steps"}
  assert got["train/loss"] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0)]
  w = summaries.TensorBoardWriter(d)
  w.resume_at(2)                         # as MetricsWriter.resume_at does on a resume
  for step in (3, 4, 5):
    w.write({"step": step, "loss": 100.0 + step})
  w.close()
  assert summaries.read_scalars(d)["train/loss"] == [(1, 9.0), (2, 8.0), (3, 103.0),
                                                     (4, 104.0), (5, 105.0)]


def test_metrics_writer_sends_each_line_to_tensorboard(tmp_path):
  """train.MetricsWriter (what train.run logs through): every metrics.jsonl line's scalars
  at its step, non-finite ones included; a resume drops the later points of both."""
  w = train.MetricsWriter(str(tmp_path / "metrics.jsonl"), tensorboard=str(tmp_path / "tb"))
  for step in (1, 2, 3):
    w.write({"step": step, "loss": float("nan") if step == 3 else 1.0 / step,
             "tokens_per_sec": 100.0 * step, "goodput": 0.5, "qk_clipped_heads": 1.0})
  w.close()
  w = train.MetricsWriter(str(tmp_path / "metrics.jsonl"), tensorboard=str(tmp_path / "tb"))
  assert w.resume_at(2) == 0
  w.write({"step": 3, "loss": 0.25, "tokens_per_sec": 1.0, "goodput": 0.75})
  w.close()
  got = summaries.read_scalars(str(tmp_path / "tb"))
  assert got["train/loss"] == [(1, 1.0), (2, 0.5), (3, 0.25)]
  assert got["speed/tokens_per_sec"] == [(1, 100.0), (2, 200.0), (3, 1.0)]
  assert got["qk_clip/clipped_heads"] == [(1, 1.0), (2, 1.0)]
  assert [json.loads(l)["step"] for l in open(tmp_path / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.slow
def test_a_training_run_writes_its_metrics_to_tensorboard(tmp_path):
  """A 2-step k3_tiny-like run on a prepared dataset: every numeric field of every
  metrics.jsonl line is a TensorBoard scalar at its step, with its value."""
  corpus = tmp_path / "c.jsonl"
  corpus.write_text("".join(json.dumps({"text": f"{i}: the quick brown fox jumps over the "
                                                f"lazy dog. " * (i + 1)}) + "\n"
                            for i in range(8)))
  data = str(tmp_path / "data")
  prepare.prepare(str(corpus), data, fmt="arrayrecord", num_shards=2, progress=False)
  cfg = dataclasses.replace(configs.get("k3_tiny"), num_layers=2, mla_layers=(2,),
                            dense_layers=(1,))
  tc = dataclasses.replace(configs.get_train("k3_tiny"), steps=2, batch_size=2, seq_len=16,
                           eval_every=2, log_every=1, dataset=data)
  it, evals = datasets.train_data(cfg, tc)
  mesh = make_mesh(parse_mesh(""), devices=jax.devices()[:1])
  work = str(tmp_path / "run")
  train.run(cfg, tc, work, mesh, it, evals, log=lambda m: None)
  with open(os.path.join(work, "metrics.jsonl")) as f:
    lines = [json.loads(l) for l in f]
  assert [r["step"] for r in lines] == [1, 2]
  got = summaries.read_scalars(os.path.join(work, "tensorboard"))
  for key in ("loss", "eval_loss", "lr_adamw", "grad_norm", "tokens_per_sec", "goodput",
              "load_max_mean", "max_logit"):
    assert key in lines[-1], key
  for rec in lines:
    for key, value in rec.items():
      if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
        continue
      points = dict(got[summaries.tag_of(key)])
      assert points[rec["step"]] == pytest.approx(value, rel=1e-6), key
