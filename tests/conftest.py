"""Test setup: CPU only, 8 host devices for mesh tests (must precede the jax import)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
