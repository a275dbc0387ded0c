"""The engine's output stage (serve/output.py) on plain requests, without a model: what a
sampled token does to a request's text, its finish reason and its stream (exact strings)."""

import numpy as np

from k3_jax.data.tokenizers import ByteTokenizer
from k3_jax.serve import output
from k3_jax.serve.requests import Request, SamplingParams

TOK = ByteTokenizer()


def feed(text, **params):
  """A request fed `text` byte by byte -> (request, finish reason per token, updates)."""
  got = []
  r = Request(np.array([1], np.int32), SamplingParams(**params),
              on_update=lambda r, delta: got.append(delta))
  r.decoder = TOK.stream_decoder()
  reasons = []
  for tid in TOK.encode(text):
    reasons.append(output.accept(r, tid, TOK))
    if reasons[-1] is None:
      output.stream(r)
    else:
      output.push(r)
      break
  return r, reasons, got


def test_stop_string_across_tokens_is_cut_and_never_streamed():
  r, reasons, got = feed("hello world", max_tokens=50, stop=("lo w",))
  assert reasons[-1] == "stop" and r.text == "hel"
  assert "".join(got) == "hel" and not any("w" in d for d in got)
  assert r.output_ids == TOK.encode("hello w")      # the stop's tokens are counted


def test_length_stop_id_and_utf8_across_tokens():
  r, reasons, got = feed("héllo", max_tokens=3)
  assert reasons == [None, None, "length"] and r.text == "hé" and "".join(got) == "hé"
  r, reasons, _ = feed("ab\ncd", max_tokens=50, stop_ids=(10,))
  assert reasons[-1] == "stop" and r.text == "ab" and r.output_ids[-1] == 10


def test_ids_past_the_tokenizer_read_as_replacement():
  r = Request(np.array([1], np.int32), SamplingParams(max_tokens=5))
  r.decoder = TOK.stream_decoder()
  assert output.accept(r, 300, TOK) is None and r.text == "\ufffd"


def test_bias_rows():
  r = Request(np.array([1], np.int32), SamplingParams(logit_bias=((3, 2.5), (7, -100.0))))
  row = output.bias_row(r, 10)
  assert row[3] == 2.5 and row[7] == -100.0 and np.count_nonzero(row) == 2
  assert output.biases([r, Request(np.array([1], np.int32), SamplingParams())], 10).keys() \
      == {r.id}
