"""The engine loop's admission window (client.settle): an idle engine waits for a burst's
requests to arrive before its first prefill when --admit_gap_ms is set, and never otherwise.
Plain objects stand in for the engine (exact comparisons of seconds)."""

import types

import pytest

from k3_jax.config import ServeConfig
from k3_jax.serve.client import settle


def engine(arrivals, busy=False, gap=20.0, window=50.0, max_batch=8):
  return types.SimpleNamespace(
      serve=ServeConfig(admit_gap_ms=gap, admit_window_ms=window), max_batch=max_batch,
      waiting=[types.SimpleNamespace(arrival=a) for a in arrivals], busy=lambda: busy)


def test_default_admits_at_once():
  assert ServeConfig().admit_gap_ms == 0
  assert settle(engine([10.0], gap=ServeConfig().admit_gap_ms), 10.0) == 0


def test_waits_for_the_gap_after_the_last_arrival_up_to_the_window():
  assert settle(engine([10.0]), 10.005) == pytest.approx(0.015)           # 20 ms gap
  assert settle(engine([10.0, 10.010]), 10.012) == pytest.approx(0.018)   # a new arrival
  assert settle(engine([10.0, 10.040]), 10.041) == pytest.approx(0.009)   # window: 10.050
  assert settle(engine([10.0, 10.010]), 10.031) == 0                      # gap passed


def test_no_wait_when_busy_full_or_idle():
  assert settle(engine([10.0], busy=True), 10.0) == 0    # decoding, or a step in flight
  assert settle(engine([10.0] * 8), 10.0) == 0                     # max_batch waiting
  assert settle(engine([]), 10.0) == 0                             # nothing waiting
