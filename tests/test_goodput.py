"""The goodput clock (k3_jax/goodput.py): compile time told apart from the span it happens
in, nested compile events counted once, and the --profile_steps values (profiling.py).
A whole run's goodput fields, summary line and trace are checked on the CLI run of
tests/test_cli.py::test_train_generate_and_refuse_other_config.
"""

import time

import jax
import jax.numpy as jnp
import pytest

from k3_jax import goodput
from k3_jax.config import UserError
from k3_jax.profiling import parse_steps


def test_compile_time_is_told_apart_from_the_span_it_happens_in():
  clock = goodput.Goodput()
  f = jax.jit(lambda x: jnp.sin(x) * 3 + 1)
  with clock.span("step"):
    f(jnp.ones((7, 13))).block_until_ready()      # traced, lowered and compiled here
  first = dict(clock.seconds)
  assert first["compile"] > 0
  with clock.span("step"):
    f(jnp.ones((7, 13))).block_until_ready()      # cached: no compile
    time.sleep(0.05)
  assert clock.seconds["compile"] == first["compile"]
  assert clock.seconds["step"] >= first["step"] + 0.05
  with pytest.raises(ValueError, match="span kind"):
    with clock.span("compile"):
      pass


def test_compile_clock_counts_nested_events_once():
  c = goodput.CompileClock()
  c("/jax/core/compile/jaxpr_trace_duration", 0.01)          # an inner jit's trace ...
  c("/jax/core/compile/jaxpr_trace_duration", 10.0)          # ... inside the outer one's
  c("/jax/some/other_event", 5.0)                            # not a compile event
  assert c.seconds() == pytest.approx(10.0, abs=0.01)
  c("/jax/core/compile/backend_compile_duration", 0.001)     # after it: added
  assert c.seconds() == pytest.approx(10.001, abs=0.01)


def test_profile_steps_flag_values():
  assert parse_steps("3:5") == (3, 5) and parse_steps("") is None
  for bad in ("5:3", "0:2", "3", "a:b"):
    with pytest.raises(UserError, match="profile_steps"):
      parse_steps(bad)
