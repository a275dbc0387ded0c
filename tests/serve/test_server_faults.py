"""Fault containment, limits and drain of the HTTP server (docs/faults.md, Serving), on a
subprocess server over the tiny 5-layer k3_tiny variant with random weights and the byte
tokenizer. The launch script injects faults keyed on the prompt's first bytes: "FAULT" raises
in the request's admission (its own host work), "FATAL" raises EngineFatal (a shared-state
fault), "TIMEOUT" gives the request a timeout of 0 s, and "SLOW" makes every engine step take at
least 10 ms while it runs (so that a drain has something to wait for however fast the machine)."""

import concurrent.futures
import json
import signal
import time

import httpx
import pytest

from tests.serve.serverproc import metric_value, start_server

MODEL = "k3-test"
LAUNCH = """
import time
import k3_jax.serve.engine as E
import k3_jax.serve.intake as I          # (admission's host work: intake.prepare)
from k3_jax.serve.requests import EngineFatal
real_hashes, real_submit, real_step = I.block_hashes, E.Engine.submit, E.Engine.step

def hashes(tokens, **kw):
  head = bytes(int(t) for t in tokens[:5])
  if head == b"FAULT":
    raise ValueError("injected admission fault")
  if head == b"FATAL":
    raise EngineFatal("injected shared-state fault")
  return real_hashes(tokens, **kw)

def submit(self, ids, *a, **kw):
  if bytes(int(t) for t in list(ids)[:7]) == b"TIMEOUT":
    kw["timeout"] = 0.0
  return real_submit(self, ids, *a, **kw)

def step(self):
  if any(bytes(int(t) for t in r.prompt[:4]) == b"SLOW" for r in self.running):
    time.sleep(0.1)
  return real_step(self)

I.block_hashes, E.Engine.submit, E.Engine.step = hashes, submit, step
from k3_jax.serve.loader import ServeOptions, run_server
from k3_jax.config import ServeConfig
run_server(ServeOptions(config="k3_tiny", overrides=("max_seq_len=1024", "num_layers=5",
           "mla_layers=(4,5)"), seed=3, model_name="{model}",
           serve=ServeConfig(max_batch=4, max_queue=16, prefix_cache_bytes=1 << 22, warmup=False,
                             max_len=64, max_body_bytes=4096, drain_timeout=60,
                             batch_invariant=True,   # one step shape per piece: fewer compiles
                             host="127.0.0.1", port={port})))
"""
# The model, slots, 64-token context and prefix cache of test_fuzz.py's server: the same
# programs, which it loads from the session's compilation cache (tests/conftest.py `env`)
# instead of compiling them again.


def start(tmp, env):
  return start_server(LAUNCH, tmp, cache_dir=env["JAX_COMPILATION_CACHE_DIR"], model=MODEL)


def stop(proc):
  if proc.poll() is None:
    proc.kill()
  proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory, env):
  proc, base, log = start(tmp_path_factory.mktemp("faults"), env)
  try:
    yield proc, base, log
  finally:
    stop(proc)


def post(base, prompt, n=4, **kw):
  return httpx.post(f"{base}/v1/completions", timeout=120, json={
      "model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, **kw})


def metric(base, name):
  return metric_value(httpx.get(f"{base}/metrics", timeout=10).text, name)


def test_one_bad_request_fails_alone(server):
  _, base, _ = server
  good = [f"prompt number {i}: " for i in range(3)]
  solo = [post(base, p).json()["choices"][0]["text"] for p in good]
  with concurrent.futures.ThreadPoolExecutor(4) as ex:
    futs = [ex.submit(post, base, p) for p in good[:2] + ["FAULT here"] + good[2:]]
    res = [f.result() for f in futs]
  bad = res.pop(2)
  assert bad.status_code == 500, bad.text
  err = bad.json()["error"]
  assert "injected admission fault" in err["message"] and err["type"] == "server_error"
  assert [r.status_code for r in res] == [200] * 3
  assert [r.json()["choices"][0]["text"] for r in res] == solo
  # streaming: an error event, then [DONE]
  with httpx.stream("POST", f"{base}/v1/completions", timeout=120, json={
      "model": MODEL, "prompt": "FAULT again", "max_tokens": 3, "stream": True}) as r:
    lines = [l for l in r.iter_lines() if l]
  assert lines[-1] == "data: [DONE]"
  assert "injected admission fault" in json.loads(lines[-2][6:])["error"]["message"]
  assert httpx.get(f"{base}/health", timeout=10).json()["status"] == "ok"
  assert metric(base, "k3_request_failure_total") == 2
  assert metric(base, "k3_free_slots") == 4
  assert metric(base, "k3_pinned_blocks") == 0 and metric(base, "k3_pinned_checkpoints") == 0
  assert metric(base, "k3_used_pages") == metric(base, "k3_cached_pages")


def test_timeout_is_504(server):
  _, base, _ = server
  r = post(base, "TIMEOUT soon", 50)
  assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
  assert "timeout" in r.json()["error"]["message"]
  assert post(base, "still fine").status_code == 200


def test_body_over_the_limit_is_413(server):
  _, base, _ = server
  r = post(base, "x" * 5000)
  assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"], r.text


def test_sigterm_drains_then_exits_0(server):
  proc, base, log = server
  with httpx.stream("POST", f"{base}/v1/completions", timeout=120, json={
      "model": MODEL, "prompt": "SLOW and long", "max_tokens": 48, "temperature": 0,
      "stream": True}) as r:
    it = r.iter_lines()
    first = next(l for l in it if l)
    assert first.startswith("data: ")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = post(base, "too late")
    assert refused.status_code == 503 and refused.headers.get("retry-after"), refused.text
    assert httpx.get(f"{base}/health", timeout=10).status_code == 503
    rest = [l for l in it if l]
  assert rest[-1] == "data: [DONE]"
  assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
  assert proc.wait(timeout=60) == 0
  text = log.read_text()
  assert "draining" in text and "server stopped" in text
  assert "status length" in text and "compiled decode" in text    # the request / compile logs


@pytest.mark.slow
def test_fatal_fault_stops_the_server_with_status_1(tmp_path, env):
  proc, base, log = start(tmp_path, env)
  try:
    r = post(base, "FATAL now")
    assert r.status_code == 500 and "injected shared-state fault" in r.text, r.text
    h = httpx.get(f"{base}/health", timeout=10)
    assert h.status_code == 503 and "injected" in h.json()["error"]
    assert post(base, "after").status_code == 503
    assert proc.wait(timeout=60) == 1
  finally:
    stop(proc)
