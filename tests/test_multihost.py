"""Multi-host: 2 processes x 4 CPU devices (jax.distributed on localhost, gloo collectives)
compute what 1 process x 8 devices computes, each process feeding only its half of every
global batch through train.put_batch.

The default suite runs a tiny sharded program (a few seconds of compiling); the k3_tiny
train-step comparison compiles the step three times (once per process) and is slow."""

import os

import numpy as np
import pytest

from tests.multiproc import result, run_workers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multihost_worker.py")


def _run(mode: str, nproc: int, ndev: int, timeout: int, extra_env=None) -> dict:
  return result(run_workers(WORKER, mode, nproc, ndev, timeout, extra_env)[0])


def test_two_processes_equal_one_sharded_program():
  two = _run("sum", 2, 4, timeout=300)
  one = _run("sum", 1, 8, timeout=300)
  # Exact: sums of small integers and hundredths in f32, the same per-row reductions.
  np.testing.assert_allclose(two["out"], one["out"], rtol=1e-6)
  assert np.asarray(two["out"]).shape == (2, 8, 3)


@pytest.mark.slow
def test_two_processes_equal_one_train_steps():
  two = _run("train", 2, 4, timeout=1200)
  one = _run("train", 1, 8, timeout=1200)
  # The same program over the same 8-way mesh; only the cross-process all-reduces (gloo)
  # may sum in another order: f32 agreement ~1e-6 relative.
  np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
  np.testing.assert_allclose(two["grad_norm"], one["grad_norm"], rtol=1e-4)


@pytest.mark.slow
def test_two_processes_load_only_their_safetensors_slices(tmp_path):
  """2 processes x 4 devices load a kimi_linear safetensors export straight into 8-way fsdp
  shards: each process's shards equal a plain load (checked in the worker) and process 0
  reads about half the bytes one process would (its devices' slices; replicated tensors,
  norms and biases, are read by both)."""
  from tests.checkpoint.ckpt_configs import kimi_linear_small
  from k3_jax.checkpoint import convert
  from k3_jax.model import create_model
  d = str(tmp_path / "hf")
  convert.export_model(create_model(kimi_linear_small(), seed=3), d)
  two = _run("hfload", 2, 4, timeout=600, extra_env={"K3_HF_DIR": d})
  one = _run("hfload", 1, 8, timeout=600, extra_env={"K3_HF_DIR": d})
  assert two["read"] == two["owned"]           # process 0 read exactly what it holds
  assert two["read"] < 0.6 * one["read"], (two, one)
