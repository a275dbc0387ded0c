"""The engine's step planner (serve/planner.py): pure decisions, checked on plain requests
without a model or a device (exact: integers and sets)."""

import numpy as np

from k3_jax.serve import planner
from k3_jax.serve.requests import Request, SamplingParams


def req(n=10, pos=0, out=(), max_tokens=16, **kw):
  r = Request(np.arange(1, n + 1, dtype=np.int32), SamplingParams(max_tokens=max_tokens))
  r.feed, r.pos, r.output_ids = r.prompt, pos, list(out)
  for k, v in kw.items():
    setattr(r, k, v)
  return r


def test_pieces_whole_blocks_then_the_tail():
  assert planner.pieces(1300, 0, 512, 512) == [512]          # stops on the kept boundary
  assert planner.pieces(1300, 512, 512, 512) == [512]
  assert planner.pieces(1300, 1024, 512, 512) == [256, 16, 4]
  assert planner.pieces(3000, 0, 1024, 512) == [1024]
  assert planner.pieces(3000, 0, 100, 512) == [512]           # at least one block
  assert planner.pieces(100, 0, 512, 512) == [64, 16, 16, 4]
  # a finer grid: the pieces end on each kept checkpoint, never cross a block boundary
  assert planner.pieces(600, 0, 512, 64) == [512]
  assert planner.pieces(600, 512, 512, 64) == [64, 16, 4, 4]


def test_prefill_shares_the_budget_oldest_first():
  a, b, c = req(100), req(1300), req(50)
  plans = planner.prefill([a, b, c], 512, 512)
  assert [(r is x, s) for (r, s), x in zip(plans, (a, b))] == [(True, [64, 16, 16, 4]),
                                                               (True, [512])]
  assert len(plans) == 2                      # the budget is spent before c
  assert planner.rounds(plans) == 4


def test_calls_group_one_size_in_rows():
  rs = [req(100) for _ in range(5)]
  plans = [(r, [64, 16]) for r in rs[:3]] + [(r, [16, 4]) for r in rs[3:]]
  calls = planner.calls(plans, 0, 2)
  assert [(size, len(g)) for size, g in calls] == [(64, 2), (64, 1), (16, 2)]
  calls = planner.calls(plans, 1, 4, alive=lambda r: r is not rs[0])
  assert [(size, [rs.index(r) for r in g]) for size, g in calls] == [(16, [1, 2]),
                                                                    (4, [3, 4])]
  assert planner.calls(plans, 2, 4) == []
  seven = [(r, [512]) for r in [req(512) for _ in range(7)]]      # no call needs padding
  assert [len(g) for _, g in planner.calls(seven, 0, 8)] == [4, 2, 1]
  assert [len(g) for _, g in planner.calls(seven, 0, 3)] == [2, 2, 2, 1]


def test_decode_rows_run_ahead_only_when_the_unread_token_cannot_end_it():
  a, b, c, d = req(out=[1]), req(out=[1] * 15), req(out=[1]), req(out=[1], cancelled=True)
  now, ahead = planner.decode_rows([a, b, c, d], {id(a), id(b), id(d)})
  assert ahead == {id(a)}                     # b's unread token may be its last; d is cancelled
  assert now == [a, c]
  assert planner.read_first(True, False, [a]) and not planner.read_first(True, True, [a])
  assert planner.read_first(True, True, [a, req(constraint=object())])
  assert not planner.read_first(False, False, [a])


def test_victim_expired_cancelled_and_feed():
  a, b = req(admitted=3), req(admitted=7)
  assert planner.victim([a, b]) is b
  old = req(timeout=1.0)
  old.arrival -= 5
  gone = req(cancelled=True, timeout=1.0)
  gone.arrival -= 5
  assert planner.expired([old, a], [gone], old.arrival + 5.5) == [old]
  assert planner.cancelled([a, gone]) == [gone]
  r = req(4, out=[9, 8, 7])
  np.testing.assert_array_equal(planner.feed(r), [1, 2, 3, 4, 9, 8])
  assert planner.feed(req(4)) is not None and planner.feed(req(4)).size == 4


def test_decode_slots_pad_to_a_power_of_two_unless_batch_invariant():
  assert planner.decode_slots([5, 2, 6], 8, True) is None
  assert planner.decode_slots([5, 2, 6], 8, False).tolist() == [2, 5, 6, 0]
  assert planner.decode_slots([3], 8, False).tolist() == [3]
  assert planner.decode_slots(list(range(5)), 8, False) is None     # 8 rows: all slots
