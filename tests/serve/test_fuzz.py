"""API fuzzing with schemathesis against the server's own OpenAPI schema (api_schema.py's
models, which validate the request bodies): requests generated from the schema, loopback only,
bounded in count and time. No response may be a 5xx, none may hang (a per-request timeout),
and the server is healthy and idle afterwards. The server: the tiny 5-layer k3_tiny variant
with random weights, a 64-token context (so generated requests stay cheap), 4 slots, batch
invariant (one prompt a prefill call, every decode over all slots: the few step shapes the
warm-up request compiles, so no fuzzed request waits past request_timeout on a compile).
Then bodies generated outside the schema (schemathesis' negative mode) to each POST
endpoint: every one must be a 4xx, as the schema served is the one that validates.
Short run: 25 examples per operation and 10 outside the schema per POST endpoint (about 90
requests, 5 s after a 35 s start); long run: thousands in all, marked slow."""

import collections
import time

import httpx
import pytest
import schemathesis            # pinned: a missing one fails here, never skips
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.serve.serverproc import start_server

LAUNCH = """
from k3_jax.serve.loader import ServeOptions, run_server
from k3_jax.config import ServeConfig
run_server(ServeOptions(config="k3_tiny", overrides=("max_seq_len=1024", "num_layers=5",
           "mla_layers=(4,5)"), seed=3, model_name="k3-test",
           serve=ServeConfig(max_batch=4, max_queue=64, prefix_cache_bytes=1 << 22, max_len=64,
                             request_timeout=30, batch_invariant=True, warmup=False,
                             host="127.0.0.1", port={port})))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory, env):
  # the session's compilation cache (tests/conftest.py `env`): test_server_faults.py's server
  # runs the same programs (same model, slots, context, prefix cache) and loads them from it
  proc, base, log = start_server(LAUNCH, tmp_path_factory.mktemp("fuzz"),
                                 cache_dir=env["JAX_COMPILATION_CACHE_DIR"])
  try:
    # compile every step shape a 64-token context uses (prefill pieces 16, 4, 1; decode)
    # before fuzzing, so that the fuzz budget goes to requests
    r = httpx.post(f"{base}/v1/completions", timeout=300,
                   json={"prompt": "x" * 21, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    yield base, log
  finally:
    proc.kill()
    proc.wait(timeout=30)


def fuzz(base, per_operation: int, seconds: float,
         mode: GenerationMode = GenerationMode.POSITIVE) -> collections.Counter:
  """Status counts of requests generated from the served schema. NEGATIVE: bodies outside
  it, sent to the POST endpoints, each of which must be refused with a 4xx (the schema
  served is the one that validates)."""
  schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
  counts: collections.Counter = collections.Counter()
  stop_at = time.monotonic() + seconds
  negative = mode == GenerationMode.NEGATIVE
  for result in schema.get_all_operations():
    op = result.ok()
    if negative and op.method.upper() != "POST":
      continue

    @settings(max_examples=per_operation, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(mode))
    def one(case):
      if time.monotonic() > stop_at:
        return
      resp = case.call(base_url=base, timeout=60)
      counts[resp.status_code] += 1
      assert resp.status_code < 500, (op.label, case.body, resp.status_code, resp.text[:500])
      assert not negative or resp.status_code >= 400, (op.label, case.body, resp.text[:500])
    one()
  return counts


def healthy_and_idle(base):
  h = httpx.get(f"{base}/health", timeout=10)
  assert h.status_code == 200 and h.json()["status"] == "ok", h.text
  metrics = {l.split()[0]: float(l.split()[-1]) for l in
             httpx.get(f"{base}/metrics", timeout=10).text.splitlines()
             if l and not l.startswith("#")}
  assert metrics["k3_free_slots"] == 4 and metrics["k3_pinned_blocks"] == 0
  assert metrics["k3_used_pages"] == metrics["k3_cached_pages"]


def test_fuzz_short(server):     # ~40 s alone, 35 of them the server's start and compiles
  base, log = server
  counts = fuzz(base, per_operation=25, seconds=20)
  print("fuzz status counts:", dict(sorted(counts.items())))
  assert sum(counts.values()) >= 30
  refused = fuzz(base, per_operation=10, seconds=10, mode=GenerationMode.NEGATIVE)
  print("bodies outside the schema:", dict(sorted(refused.items())))
  assert sum(refused.values()) >= 20
  healthy_and_idle(base)


@pytest.mark.slow
def test_fuzz_long(server):
  base, log = server
  counts = fuzz(base, per_operation=800, seconds=1200)
  print("fuzz status counts:", dict(sorted(counts.items())))
  assert sum(counts.values()) >= 1500     # 1,603 measured (derandomized generation)
  refused = fuzz(base, per_operation=200, seconds=300, mode=GenerationMode.NEGATIVE)
  print("bodies outside the schema:", dict(sorted(refused.items())))
  assert sum(refused.values()) >= 600     # 800 measured (derandomized generation)
  healthy_and_idle(base)
