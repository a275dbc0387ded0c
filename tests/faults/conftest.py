"""Shared fixtures of the fault tests (both files): one uninterrupted reference run per
session (the subprocess environment `env`, with its JAX compilation cache, is in
tests/conftest.py: the CLI tests share it)."""

import pytest

from faultcli import RUN, STEPS, main, metrics


@pytest.fixture(scope="session")
def reference(env, tmp_path_factory):
  """An uninterrupted run: the losses every fault scenario must reproduce."""
  wd = str(tmp_path_factory.mktemp("faults") / "reference")
  r = main(env, "train", *RUN, f"--workdir={wd}")
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  assert [m["step"] for m in metrics(wd)] == list(range(1, STEPS + 1))
  return wd


