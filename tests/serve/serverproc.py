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


def start_server(launch: str, log_dir, **fmt):
  """launch: Python source with a {port} field (and the fields of `fmt`). -> (process,
  base URL, log path)."""
  port = multiproc.free_port("127.0.0.1")
  log = log_dir / "server.log"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT,
         "XLA_FLAGS": ""}                       # one CPU device is enough here
  with open(log, "w") as out:
    proc = subprocess.Popen([sys.executable, "-c", launch.format(port=port, **fmt)],
                            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
  base = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 300
  while True:
    if proc.poll() is not None:
      pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
    try:
      if httpx.get(f"{base}/health", timeout=2).status_code == 200:
        return proc, base, log
    except httpx.HTTPError:
      pass
    if time.monotonic() > deadline:
      proc.kill()
      pytest.fail(f"server did not come up in 300 s:\n{log.read_text()[-3000:]}")
    time.sleep(0.3)


def stop_server(proc, grace: float = 20):
  """SIGTERM, then SIGKILL after `grace` seconds."""
  if proc.poll() is None:
    proc.terminate()
    try:
      proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
      proc.kill()
  proc.wait(timeout=30)
