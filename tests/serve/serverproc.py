"""A server subprocess for the HTTP tests: started from a launch snippet, waited for until
/health answers 200 (failing the test with the log's tail if it exits or takes 300 s)."""

import os
import subprocess
import sys
import time

import httpx
import pytest

from tests import multiproc

ROOT = multiproc.ROOT


def start_server(launch: str, log_dir, cache_dir: str | None = None, **fmt):
  """launch: Python source with a {port} field (and the fields of `fmt`). cache_dir: a JAX
  compilation cache for the server (servers of the same programs then compile them once).
  -> (process, base URL, log path)."""
  port = multiproc.free_port("127.0.0.1")
  log = log_dir / "server.log"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT,
         "XLA_FLAGS": ""}                       # one CPU device is enough here
  if cache_dir:
    env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
  with open(log, "w") as out:
    proc = subprocess.Popen([sys.executable, "-c", launch.format(port=port, **fmt)],
                            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
  base = f"http://127.0.0.1:{port}"
  _wait_for_health(base, [proc], [log], 300)
  return proc, base, log


def _wait_for_health(base: str, procs, logs, timeout: float) -> None:
  """Polls base/health until it answers 200; fails the test with a log's tail (and kills
  the processes) when one of them exits first or `timeout` seconds pass."""
  deadline = time.monotonic() + timeout
  while True:
    for p, log in zip(procs, logs):
      if p.poll() is not None:
        _kill(procs)
        pytest.fail(f"{log.name}: the server exited with {p.returncode}:\n"
                    f"{log.read_text()[-3000:]}")
    try:
      if httpx.get(f"{base}/health", timeout=2).status_code == 200:
        return
    except httpx.HTTPError:
      pass
    if time.monotonic() > deadline:
      _kill(procs)
      pytest.fail(f"the server did not come up in {timeout:g} s:\n{logs[0].read_text()[-3000:]}")
    time.sleep(0.3)


def _kill(procs) -> None:
  for p in procs:
    if p.poll() is None:
      p.kill()


def metric_value(text: str, name: str, default: float | None = None) -> float:
  """The value of the sample `name` in a /metrics page (Prometheus text); `default` when it
  is absent, or an AssertionError when there is none."""
  for line in text.splitlines():
    if line.startswith(name + " "):
      return float(line.split()[-1])
  if default is None:
    raise AssertionError(f"{name} not in /metrics")
  return default


def stop_server(proc, grace: float = 20):
  """SIGTERM, then SIGKILL after `grace` seconds."""
  if proc.poll() is None:
    proc.terminate()
    try:
      proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
      proc.kill()
  proc.wait(timeout=30)


def start_group(nproc: int, ndev: int, log_dir, flags, timeout: float = 400):
  """`main.py serve FLAGS` as nproc processes of ndev CPU devices each (a multi-host job on
  localhost when nproc > 1) -> (processes, base URL, log paths), once process 0's /health
  answers 200 (failing with a log's tail if any process exits first)."""
  port, coord = multiproc.free_port("127.0.0.1"), multiproc.free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT,
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={ndev}"}
  procs, logs = [], []
  for pid in range(nproc):
    args = [f"--port={port}", *flags]
    if nproc > 1:
      args += [f"--coordinator_address=localhost:{coord}", f"--num_processes={nproc}",
               f"--process_id={pid}"]
    log = log_dir / f"p{pid}.log"
    with open(log, "w") as out:
      procs.append(subprocess.Popen([sys.executable, "main.py", "serve", *args], cwd=ROOT,
                                    env=env, stdout=out, stderr=subprocess.STDOUT))
    logs.append(log)
  base = f"http://127.0.0.1:{port}"
  _wait_for_health(base, procs, logs, timeout)
  return procs, base, logs


def stop_group(procs, grace: float = 30) -> list[int]:
  """SIGTERM to process 0 (it drains, then stops the others), SIGKILL after `grace`
  seconds -> every process's exit status."""
  if procs[0].poll() is None:
    procs[0].terminate()
  codes = []
  for p in procs:
    try:
      codes.append(p.wait(timeout=grace))
    except subprocess.TimeoutExpired:
      p.kill()
      codes.append(p.wait(timeout=30))
  return codes
