"""Shared serving fixtures (one compile of the 8-slot tiny engine for every module)."""

import pytest

from k3_jax import train
from k3_jax.model import create_model
from k3_jax.serve.engine import Engine
from tests.serve.test_engine import tiny_serving_config


@pytest.fixture(scope="session")
def engine8():
  """An 8-slot batch-invariant engine on the tiny serving config, no prefix cache,
  512-token context (its tests compare a request's logits across batches bitwise)."""
  cfg = tiny_serving_config()
  g, p, r = train.split_model(create_model(cfg, seed=3))
  return Engine(cfg, g, p, r, max_batch=8, prefix_cache_bytes=0, max_len=512,
                batch_invariant=True)


@pytest.fixture(scope="session")
def speculator8(engine8):
  """A prompt-lookup Speculator (k = 3) over engine8, not attached: its verify step compiles
  once for the tests that verify (test_verify.py) or attach it (test_speculate.py)."""
  from k3_jax.serve.speculate import Speculator
  return Speculator(engine8, "ngram", 3)


@pytest.fixture(scope="session")
def prefix_setup():
  """(cfg, model, engine): the 2-slot tiny engine with a prefix cache of about four 512-token
  blocks and their checkpoints (test_engine.py's; engines of the same shapes reuse its
  compiled steps: `other.runner.steps = engine.runner.steps`)."""
  from k3_jax.config import SINGLE_STREAM
  from k3_jax.data.tokenizers import ByteTokenizer
  from k3_jax.serve.kv_pages import PAGE
  cfg = tiny_serving_config()
  model = create_model(cfg, seed=3)
  g, p, r = train.split_model(model)
  probe = Engine(cfg, g, p, r, SINGLE_STREAM, max_len=PAGE)      # sizes only (no step runs)
  budget = 4 * (probe.page_bytes + probe.ckpt_bytes) + 100
  eng = Engine(cfg, g, p, r, max_batch=2, prefix_cache_bytes=budget,
               tokenizer=ByteTokenizer())
  return cfg, model, eng
