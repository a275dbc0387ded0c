"""datasets.train_data: a TrainConfig's train iterator and eval batches, as `train` uses them."""

import dataclasses

import numpy as np
import pytest

import configs
from k3_jax.config import UserError
from k3_jax.data import datasets

CFG = configs.get("k3_tiny")
TC = dataclasses.replace(configs.get_train("k3_tiny"), batch_size=4, seq_len=16,
                         eval_batches=2)


def _tokens(batch):
  """The byte ids of the real (non-padding) tokens of a batch."""
  return set(np.asarray(batch["inputs"])[np.asarray(batch["segment_ids"]) > 0].tolist())


def test_text_folder_holds_out_eval_documents(tmp_path):
  # 100 documents: every 50th (here the first 2 files in sorted order) is held out for eval.
  # Eval files hold only 'e', train files only 't', so a leak shows up as a foreign byte.
  for i in range(100):
    (tmp_path / f"{i:03d}.txt").write_text(("e" if i < 2 else "t") * 40)
  tc = dataclasses.replace(TC, dataset=str(tmp_path))
  train_iter, evals = datasets.train_data(CFG, tc)
  eos = {0}                                       # the byte tokenizer's EOS closes each doc
  assert len(evals) == tc.eval_batches
  assert set().union(*map(_tokens, evals)) - eos == {ord("e")}
  batch = next(train_iter)
  assert np.asarray(batch["inputs"]).shape == (tc.batch_size, tc.seq_len)
  assert _tokens(batch) - eos == {ord("t")}
  # Two processes each get half the rows of the global batch.
  half_iter, half_evals = datasets.train_data(CFG, tc, process_index=1, process_count=2)
  assert np.asarray(next(half_iter)["inputs"]).shape == (tc.batch_size // 2, tc.seq_len)
  assert np.asarray(half_evals[0]["inputs"]).shape[0] == tc.batch_size // 2


def test_mqar_eval_stream_differs_from_train():
  tc = dataclasses.replace(TC, dataset="mqar", seq_len=32)
  train_iter, evals = datasets.train_data(CFG, tc)
  assert len(evals) == 2
  assert not np.array_equal(np.asarray(next(train_iter)["inputs"]),
                            np.asarray(evals[0]["inputs"]))


def test_input_errors_are_user_errors(tmp_path):
  with pytest.raises(UserError, match="divisible"):
    datasets.train_data(CFG, TC, process_index=0, process_count=3)
  small = dataclasses.replace(CFG, vocab_size=100)
  with pytest.raises(UserError, match="vocab_size=100"):
    datasets.train_data(small, TC)
  with pytest.raises(UserError, match="seq_len=16 too short"):
    datasets.train_data(CFG, dataclasses.replace(TC, dataset="mqar"))
  with pytest.raises(FileNotFoundError, match="not found"):
    datasets.train_data(CFG, dataclasses.replace(TC, dataset=str(tmp_path / "missing")))
