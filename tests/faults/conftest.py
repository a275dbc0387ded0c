"""Shared fixtures of the fault tests (both files): one JAX compilation cache and one
uninterrupted reference run per session."""

import os

import pytest

from faultcli import RUN, STEPS, main, metrics


@pytest.fixture(scope="session")
def env(tmp_path_factory):
  e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
           JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
           JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  e.pop("XLA_FLAGS", None)          # one CPU device, as a user would have
  for k in ("K3_TEST_HOLD_AFTER_STEP", "K3_TEST_HOLD_SIGNALS", "K3_TEST_SIGKILL_IN_SAVE"):
    e.pop(k, None)
  return e


@pytest.fixture(scope="session")
def reference(env, tmp_path_factory):
  """An uninterrupted run: the losses every fault scenario must reproduce."""
  wd = str(tmp_path_factory.mktemp("faults") / "reference")
  r = main(env, "train", *RUN, f"--workdir={wd}")
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  assert [m["step"] for m in metrics(wd)] == list(range(1, STEPS + 1))
  return wd


