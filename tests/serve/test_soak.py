"""A small soak (benchmarks/serve_soak.py; the full 2,000-request run is the benchmark):
concurrent clients, cancellations, constant eviction; nothing drifts or leaks."""

import pytest

from benchmarks.serve_soak import soak


@pytest.mark.slow
def test_soak_completes_exactly_and_frees_everything():
  out = soak(requests=240, clients=16, slots=8, distinct=24)
  assert out["failed"] == 0, out["errors"]
  assert out["completed"] + out["cancelled"] == 240 and out["cancelled"] > 0
  assert out["differ_from_cold"] == 0               # every completed request == its cold run
  assert out["all_free"], out["resources_after"]
  assert out["evictions"] > 0                        # the budget really was too small
