"""Test setup: CPU only, 8 host devices for mesh tests (must precede the jax import), and
XLA:CPU's LLVM backend at optimization level 0.

Most of the suite's time is compiling tiny configs, and most of a compile is LLVM's
code generation: the test_train step took 25 s to compile at the default level and 11.6 s
at 0. The optimized HLO (fusion, layout, the order of every reduction) is the same text at
both levels; what level 0 changes is the last bit of some float32 results, where LLVM's
code for an elementwise fusion rounds differently (three train steps: the same loss to the
bit, the optimizer moments within ~1e-6 relative). Every bitwise comparison in the suite is
between two programs compiled here, and every comparison with a reference (numpy,
transformers) has a tolerance far above that. The whole default suite: 960 s -> 704 s on
2 cores, run back to back. Users' programs (main.py, benchmarks/) compile at XLA's default
level."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
LLVM_O0 = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), LLVM_O0,
                                    "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def env(tmp_path_factory):
  """The environment of CLI subprocesses: one CPU device as a user would have (LLVM at
  level 0 as in the suite's own process; subprocesses that build their own XLA_FLAGS, such
  as tests/serve/serverproc.py's servers, compile at the default level), and one JAX
  compilation cache per session, so
  runs of the same program (the fault tests' model in tests/faults and tests/test_cli.py)
  compile it once."""
  e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
           JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
           JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  e["XLA_FLAGS"] = LLVM_O0          # one CPU device, as a user would have
  for k in ("K3_TEST_HOLD_AFTER_STEP", "K3_TEST_HOLD_SIGNALS", "K3_TEST_SIGKILL_IN_SAVE"):
    e.pop(k, None)
  return e


# The K3-format test tokenizer (k3_jax/data/bpe.py): merges learned from this fixed text (so
# its ids, which tests pin, never change), the K3 pre-tokenizer regex, the K3 special tokens
# at their released ids.
K3_TOKENIZER_TEXT = """\
<|open|>message role="user"<|sep|> <|close|>message<|sep|> role="assistant" role="system"
role="tool" think response tools call tool="get_weather" index="1" argument key="city"
type="string" type="number" type="object" type="array" type="boolean" type="null"
The quick brown fox jumps over the lazy dog. What is the weather in Paris today? It is sunny
and 21 degrees. Let me think about the question step by step before I call a tool.
def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n
{"city": "Paris", "unit": "celsius", "days": [1, 2, 3], "verbose": true}
Kimi K3 is a hybrid model: Kimi Delta Attention layers and gated MLA layers, with latent
mixture-of-experts feed-forward blocks. 你好，世界。天气很好。 Ünïcode façade naïve café.
"""


@pytest.fixture(scope="session")
def k3_tokenizer_dir(tmp_path_factory):
  """A directory in Kimi's tokenizer format (tiktoken.model + tokenizer_config.json)."""
  from k3_jax.data import bpe
  ranks = bpe.learn_ranks([K3_TOKENIZER_TEXT] * 4, num_merges=400)
  return bpe.write_kimi_dir(tmp_path_factory.mktemp("k3_tokenizer"), ranks)


@pytest.fixture(scope="session")
def k3_tokenizer(k3_tokenizer_dir):
  from k3_jax.data.tokenizers import get_tokenizer
  return get_tokenizer(str(k3_tokenizer_dir))
