"""The start-up warm-up (serve/warmup.py): which step shapes it runs, and that it leaves
nothing behind (prefix cache, counters, slots, pages, a request's output bit for bit).

Runs on the session's 2-slot prefix-cache engine (conftest.prefix_setup), whose compiled
steps the other engine tests share, so it compiles little of its own."""

import logging

import jax
import numpy as np

from k3_jax.serve.engine import SamplingParams
from k3_jax.serve.kv_pages import PAGE
from k3_jax.serve.warmup import groups, prompt_tokens, warm_up


def test_groups_double_up_to_max_batch_and_prompts_fit_max_len():
  assert groups(1) == [1]
  assert groups(8) == [1, 2, 4, 8]
  assert groups(6) == [1, 2, 4, 6]
  assert prompt_tokens(1 << 20, 8) == PAGE         # a page where there is room
  assert prompt_tokens(64, 8) == 54                # prompt + 10 generated tokens = max_len
  assert prompt_tokens(9, 8) == 0                  # no room: that group is skipped


def _run(eng, prompt):
  req = eng.submit(prompt, SamplingParams(max_tokens=3), record_logits=True,
                   use_prefix_cache=False)
  eng.run_until_done([req])
  return req


def test_warm_up_runs_each_row_count_and_leaves_nothing_behind(prefix_setup):
  _, _, eng = prefix_setup
  prompt = np.random.default_rng(11).integers(1, 256, 300).astype(np.int32)
  before_req = _run(eng, prompt)
  seen = []                                      # (what, rows, tokens a row) of each step
  real_prefill, real_decode = eng.runner.prefill, eng.runner.decode

  def prefill(live, size, *a):
    seen.append(("prefill", len(live), size))
    return real_prefill(live, size, *a)

  def decode(now, *a, **kw):
    seen.append(("decode", len(now), 1))
    return real_decode(now, *a, **kw)

  state = lambda: (eng.resource_counts(), eng.prefix.stats(), eng.generated_tokens,
                   eng.finished_requests, eng.failed_requests, eng.kv.preemptions)
  before = state()
  eng.runner.prefill, eng.runner.decode = prefill, decode
  try:
    shapes, seconds = warm_up(eng)
  finally:
    del eng.runner.prefill, eng.runner.decode        # the class's methods again
  assert shapes >= 0 and seconds > 0
  # one request alone, then both slots' prompts in one call and a decode step over both
  assert ("prefill", 1, PAGE) in seen and ("prefill", 2, PAGE) in seen
  assert ("decode", 1, 1) in seen and ("decode", 2, 1) in seen
  assert state() == before                     # no cache entry, count, slot or page left
  after_req = _run(eng, prompt)
  assert after_req.output_ids == before_req.output_ids
  for a, b in zip(after_req.logits, before_req.logits):
    np.testing.assert_array_equal(a, b)        # the same computations on a clean slot


def test_loaded_weights_state_starts_where_the_steps_return_it(prefix_setup):
  """Weights on a one-device mesh (as a loaded checkpoint's lie): the cache, counts, last ids
  and checkpoint rows are made on that mesh too, not as unplaced arrays. A step returns its
  state on the weights' mesh, and jit keys a compile on its arguments' shardings, so unplaced
  fresh state compiled each step's first shapes twice (measured on the served 15M
  Kimi-Linear: decode twice in the first request, zero_slot, prefill and first_token again
  in the second)."""
  from jax.sharding import NamedSharding, PartitionSpec
  from k3_jax import train
  from k3_jax.config import SINGLE_STREAM
  from k3_jax.serve.engine import Engine
  cfg, model, _ = prefix_setup
  g, p, r = train.split_model(model)
  mesh = jax.make_mesh((1,), ("data",))
  p = jax.device_put(p, NamedSharding(mesh, PartitionSpec()))
  eng = Engine(cfg, g, p, r, SINGLE_STREAM, max_len=PAGE, prefix_cache_bytes=1 << 22)
  run = eng.runner
  state = jax.tree.leaves((run.cache, run.counts, run.prev, run.ckpts))
  assert run.ckpts is not None and state
  assert all(isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh and x.committed
             for x in state)
  # The prefix cache's checkpoint steps compile ahead (the warm-up's last act), and the
  # first save / load on that state then finds them compiled: no XLA compile of either.
  assert run.compile_ckpt_steps() == 2 and run.compile_ckpt_steps() == 0
  compiles = []

  class Catch(logging.Handler):
    def emit(self, record):
      compiles.append(record.getMessage())
  catch, logger = Catch(), logging.getLogger("jax._src.dispatch")
  logger.addHandler(catch)
  try:
    with jax.log_compiles(True):
      run.save_ckpt(0, 0)
      run.load_ckpt(0, 0)
      jax.block_until_ready(run.cache)
  finally:
    logger.removeHandler(catch)
  assert not [m for m in compiles if "save_ckpt" in m or "load_slot" in m], compiles
