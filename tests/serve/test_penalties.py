"""Engine.generate with a frequency penalty: the decode step counts what it generated."""


def test_a_huge_frequency_penalty_never_repeats_a_token(engine8):
  # The session's 8-slot engine (conftest.py; the tiny 5-layer serving model): its prefill
  # piece of 4 tokens and its decode step are compiled once for every module that uses it.
  # The penalty is applied to the logits, whatever the depth or the batch.
  prompt, n = [5, 17, 99, 3], 40
  plain = list(engine8.generate(prompt, n))
  penalized = list(engine8.generate(prompt, n, frequency_penalty=1e4))
  # A random tiny model repeats itself under greedy decoding; with every generated token's
  # logit lowered by 1e4 (far more than the spread of its logits) no token comes twice.
  assert len(set(plain)) < n
  assert len(penalized) == n and len(set(penalized)) == n
  # The first token comes from the prefill logits, before anything was generated.
  assert penalized[0] == plain[0]
