"""Test setup: CPU only, 8 host devices for mesh tests (must precede the jax import)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def env(tmp_path_factory):
  """The environment of CLI subprocesses: one CPU device as a user would have, and one JAX
  compilation cache per session, so runs of the same program (the fault tests' model in
  tests/faults and tests/test_cli.py) compile it once."""
  e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
           JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
           JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  e.pop("XLA_FLAGS", None)          # one CPU device, as a user would have
  for k in ("K3_TEST_HOLD_AFTER_STEP", "K3_TEST_HOLD_SIGNALS", "K3_TEST_SIGKILL_IN_SAVE"):
    e.pop(k, None)
  return e
