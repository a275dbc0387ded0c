"""Running a worker script as N cooperating processes on localhost (jax.distributed with a
coordinator on a free port), for the multi-process tests."""

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port(host: str = "localhost") -> int:
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def run_workers(worker: str, first: str, nproc: int, ndev: int, timeout: int,
                extra_env=None) -> list[str]:
  """Runs `worker FIRST NPROC PID PORT NDEV` for each process id; -> each one's stdout
  (every worker must exit 0; otherwise the failing one's stderr is in the assertion)."""
  port = free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  env.update(extra_env or {})
  procs = [subprocess.Popen([sys.executable, worker, first, str(nproc), str(pid), str(port),
                             str(ndev)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for pid in range(nproc)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, f"worker failed ({p.returncode}):\n{err[-4000:]}"
  return [out for out, _ in outs]


def result(out: str) -> dict:
  """The JSON object a worker printed on its `RESULT ` line."""
  line = [l for l in out.splitlines() if l.startswith("RESULT ")]
  assert line, out
  return json.loads(line[0][len("RESULT "):])
