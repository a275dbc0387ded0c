"""`train --dataset=DIR` on 2 processes x 4 CPU devices (jax.distributed on localhost) gives
the same global batches, in the same order, as 1 process x 8, each process opening only half
of the shards; the data state (gathered over the processes) is the same and resumes exactly.
Three JAX processes start: slow."""

import json
import os

import pytest

from tests.multiproc import result, run_workers

from k3_jax.data import prepare

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "data", "prepared_worker.py")


def _run(data: str, nproc: int, ndev: int, timeout: int = 600) -> tuple[dict, list[str]]:
  outs = run_workers(WORKER, data, nproc, ndev, timeout)
  shards = [l for out in outs for l in out.splitlines() if l.startswith("PROCESS ")]
  return result(outs[0]), shards


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["arrayrecord", "parquet"])
def test_two_processes_give_the_global_batches_of_one(tmp_path, fmt):
  corpus = tmp_path / "c.jsonl"
  corpus.write_text("".join(json.dumps({"text": f"doc {i} " + "xyz" * (i % 37 + 1)}) + "\n"
                            for i in range(200)))
  data = str(tmp_path / "data")
  prepare.prepare(str(corpus), data, fmt=fmt, num_shards=8, progress=False)
  two, two_files = _run(data, 2, 4)
  one, _ = _run(data, 1, 8)
  assert two["batches"] == one["batches"]          # same global batches, same order
  assert two["state"] == one["state"]              # the whole job's state, gathered
  assert two["resumed"] == two["batches"][2:] and one["resumed"] == one["batches"][2:]
  assert len(two["files"]) == 4 and len(one["files"]) == 8
  per_process = [set(json.loads(l.split(" shards ", 1)[1].replace("'", '"')))
                 for l in two_files]
  assert len(per_process) == 2 and not per_process[0] & per_process[1]
  assert per_process[0] | per_process[1] == set(one["files"])
