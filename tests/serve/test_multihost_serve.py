"""Multi-host serving (k3_jax/serve/relay.py): `main.py serve` as 2 processes x 4 CPU devices
(jax.distributed on localhost, gloo collectives) behind process 0's HTTP port answers like
1 process x 8 devices and like 1 device, and a lost process ends the group.

Every configuration serves k3_tiny with the same weights (2 x 4 from a Hugging Face export of
them, read slice by slice by each process) and runs the same workload
(`_workload`): a warm-up request, then 8 concurrent ones (4 extending the warm-up's prompt,
so prefix-cache hits, 3 fresh, 1 streamed and cancelled after a few chunks).

Tolerances: greedy tokens and the streamed text must match exactly; the top-5 logprobs (the
model's log-softmax, i.e. its logits up to a per-row constant) within 1e-5. 2 x 4 and 1 x 8
run the same SPMD programs on the same 8-way mesh (only gloo's cross-process reductions may
order sums differently); 1 device runs unsplit matmuls, whose f32 sums differ by ~1e-6.
"""

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from tests import multiproc
from tests.serve import serverproc

SETTINGS = ["--config=k3_tiny", "--random_weights", "--max_batch=8", "--max_len=128",
            "--prefix_match_unit=16"]
PEER_TIMEOUT = 8       # seconds: room for heartbeat threads on a loaded 2-core machine
WARM = "The quick brown fox jumps over the lazy dog; " * 2
FRESH = ["Pack my box with five dozen liquor jugs.", "Sphinx of black quartz, judge my vow!",
         "How vexingly quick daft zebras jump."]
CANCELLED = "Jackdaws love my big sphinx of quartz."


def launch(nproc: int, ndev: int, log_dir, mesh: bool = True, hf_dir: str | None = None,
           extra: tuple = ()):
  weights = (SETTINGS[:2] if hf_dir is None
             else [f"--hf_dir={hf_dir}", "--served_model_name=k3_tiny"])
  return serverproc.start_group(
      nproc, ndev, log_dir, [*weights, *SETTINGS[2:], f"--peer_timeout={PEER_TIMEOUT}"]
      + (["--mesh=expert:-1"] if mesh else []) + list(extra))


def stop(procs) -> list[int]:
  return serverproc.stop_group(procs)


def _body(prompt: str, max_tokens: int, **kw) -> dict:
  return {"model": "k3_tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
          "logprobs": 5, **kw}


async def _complete(client, prompt: str, max_tokens: int = 10) -> dict:
  r = await client.post("/v1/completions", json=_body(prompt, max_tokens))
  r.raise_for_status()
  c = r.json()["choices"][0]
  return {"text": c["text"], "lp": c["logprobs"]["token_logprobs"],
          "top": [sorted(t.values(), reverse=True) for t in c["logprobs"]["top_logprobs"]]}


async def _cancelled(client, chunks: int = 4) -> list[str]:
  """A streamed completion closed after `chunks` text chunks -> the chunks received."""
  got = []
  async with client.stream("POST", "/v1/completions",
                           json=_body(CANCELLED, 60, stream=True)) as r:
    async for line in r.aiter_lines():
      if line.startswith("data: {"):
        got.append(json.loads(line[6:])["choices"][0]["text"])
        if len(got) >= chunks:
          break
  return got


async def _run(base: str) -> dict:
  async with httpx.AsyncClient(base_url=base, timeout=300) as client:
    warm = await _complete(client, WARM, 4)
    jobs = [_complete(client, WARM + f" {i}{i} and then", 10) for i in range(4)]
    jobs += [_complete(client, p, 10) for p in FRESH] + [_cancelled(client)]
    *done, cut = await asyncio.gather(*jobs)
    metrics = (await client.get("/metrics")).text
  hits = serverproc.metric_value(metrics, "k3_prefix_cache_hits_total")
  return {"warm": warm, "done": done, "cut": cut, "hits": hits, "metrics": metrics}


def _workload(base: str) -> dict:
  return asyncio.run(_run(base))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """The workload's answers from each layout. 2 x 4 loads a Hugging Face export of the same
  weights (--hf_dir: each process reads its own devices' slices, the sharded loader);
  the others draw them (--random_weights, seed 0)."""
  import configs
  from k3_jax.checkpoint import convert
  from k3_jax.model import create_model
  hf = str(tmp_path_factory.mktemp("hf") / "k3_tiny")
  convert.export_model(create_model(configs.get("k3_tiny"), seed=0), hf)
  out = {}
  for name, (nproc, ndev, mesh, src) in {"2x4": (2, 4, True, hf), "1x8": (1, 8, True, None),
                                         "1x1": (1, 1, False, None)}.items():
    d = tmp_path_factory.mktemp(name)
    procs, base, logs = launch(nproc, ndev, d, mesh, src)
    try:
      t0 = time.monotonic()
      out[name] = _workload(base)
      out[name]["seconds"] = time.monotonic() - t0
    finally:
      codes = stop(procs)
    out[name]["codes"] = codes
    out[name]["logs"] = [log.read_text() for log in logs]
  return out


@pytest.mark.slow          # three servers to compile (2 x 4, 1 x 8, 1 x 1): ~3 min here
def test_two_processes_serve_like_one(results):
  ref = results["1x1"]
  for name in ("2x4", "1x8"):
    got = results[name]
    assert got["hits"] > 0 and ref["hits"] > 0, "the workload must hit the prefix cache"
    assert got["hits"] == ref["hits"]
    for a, b in zip([got["warm"], *got["done"]], [ref["warm"], *ref["done"]]):
      assert a["text"] == b["text"], name
      np.testing.assert_allclose(a["lp"], b["lp"], atol=1e-5, rtol=0)
      np.testing.assert_allclose(a["top"], b["top"], atol=1e-5, rtol=0)
    assert len(got["cut"]) == 4 and got["cut"] == ref["cut"], name
  # 2 x 4 and 1 x 8 run one program: they agree more tightly still
  for a, b in zip(results["2x4"]["done"], results["1x8"]["done"]):
    np.testing.assert_allclose(a["lp"], b["lp"], atol=2e-6, rtol=0)
  two = results["2x4"]
  assert serverproc.metric_value(two["metrics"], "k3_relay_plans_total") > 0
  assert two["codes"] == [0, 0], two["logs"][1][-2000:]   # SIGTERM drains the whole group


@pytest.mark.slow          # the three servers of `results` and a 2 x 4 one
def test_two_processes_relay_verify_steps(results, tmp_path):
  """--speculative=ngram on 2 processes x 4 devices: the leader's verify steps (and their
  drafts, inside the step's host arrays) are relayed like the other steps, and the workload's
  greedy answers equal 1 device's without speculation (texts exactly, logprobs to 1e-5 as
  above, the verify step's rows adding ~1e-6: test_verify.py)."""
  procs, base, logs = launch(2, 4, tmp_path, extra=("--speculative=ngram",
                                                    "--num_speculative_tokens=3"))
  try:
    got = _workload(base)
  finally:
    codes = stop(procs)
  assert serverproc.metric_value(got["metrics"], "k3_spec_verify_steps_total") > 0
  ref = results["1x1"]
  for a, b in zip([got["warm"], *got["done"]], [ref["warm"], *ref["done"]]):
    assert a["text"] == b["text"]
    np.testing.assert_allclose(a["lp"], b["lp"], atol=1e-5, rtol=0)
  assert codes == [0, 0], [log.read_text()[-2000:] for log in logs]


@pytest.mark.slow          # a 2 x 4 server to compile: ~1 min here
def test_losing_process_one_ends_process_zero(tmp_path):
  """kill -9 of process 1 mid-stream: process 0 exits non-zero within peer_timeout
  plus a few seconds, naming process 1 in one line."""
  procs, base, logs = launch(2, 4, tmp_path)
  try:
    with httpx.Client(base_url=base, timeout=300) as client:
      client.post("/v1/completions", json=_body("warm up", 4)).raise_for_status()
      with client.stream("POST", "/v1/completions",
                         json=_body("a long one", 100, stream=True)) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
          pass
        procs[1].kill()
        t0 = time.monotonic()
        try:
          for _ in lines:
            pass
        except httpx.HTTPError:
          pass                                       # process 0 went away mid-stream
    code = procs[0].wait(timeout=60)
    took = time.monotonic() - t0
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert code != 0
  assert took < PEER_TIMEOUT + 10, took
  lost = [l for l in logs[0].read_text().splitlines() if "lost process 1" in l]
  assert len(lost) == 1, logs[0].read_text()[-3000:]


def test_two_processes_without_a_mesh_are_refused(tmp_path):
  """Both processes of a multi-host serve without --mesh exit 2 with one error line, before
  loading anything."""
  port, coord = multiproc.free_port("127.0.0.1"), multiproc.free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": multiproc.ROOT,
         "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
  procs = [subprocess.Popen(
      [sys.executable, "main.py", "serve", "--config=k3_tiny", "--random_weights",
       f"--port={port}", f"--coordinator_address=localhost:{coord}", "--num_processes=2",
       f"--process_id={i}"], cwd=multiproc.ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = [p.communicate(timeout=240)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 2, out[-2000:]
    assert ("error: multi-host serving needs --mesh over all 8 devices of the 2 processes "
            "(e.g. --mesh=expert:-1)") in out, out[-2000:]
