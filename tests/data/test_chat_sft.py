"""Chat SFT data (k3_jax/data/chat_sft.py): conversations rendered by the server's template
give the server's prompt ids and a mask over exactly the assistant's tokens; packed rows keep
conversations apart (the loss of a packed batch is the sum of each conversation's own); a
prepared chat directory gives the same batches as its .jsonl; bad data is one clear error."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

import configs
from k3_jax import train
from k3_jax.config import UserError, apply_overrides
from k3_jax.data import bpe, chat_sft, datasets, prepare, tokenizers
from k3_jax.data import chat

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
AGENTIC = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris now?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny 21"},
    {"role": "assistant", "content": "Sunny, 21 degrees.", "reasoning_content": "It is sunny."},
]
MULTI = [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "OLD-REASONING"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "NEW-REASONING"},
]


def small_k3_tokenizer_dir(path, texts, num_merges=60, vocab_size=320):
  """A K3-format tokenizer (tiktoken.model + tokenizer_config.json with the K3 special tokens)
  of a small vocabulary: the 256 bytes and up to `num_merges` merges below id 300, the K3
  special tokens from 300 up, so a model of vocab_size ids trains fast on CPU."""
  names = list(tokenizers.KIMI_SPECIAL_TOKENS)
  special = {n: 300 + i for i, n in enumerate(names)}
  ranks = bpe.learn_ranks(texts, num_merges=min(num_merges, 300 - 256))
  return bpe.write_kimi_dir(path, ranks, special_tokens=special, vocab_size=vocab_size)


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory):
  d = small_k3_tokenizer_dir(tmp_path_factory.mktemp("small_k3_tok"),
                             [json.dumps(AGENTIC + MULTI)] * 3)
  return tokenizers.get_tokenizer(str(d))


def _conv(messages, tools=None, **kw):
  rec = {"messages": messages, **({"tools": tools} if tools else {}), **kw}
  return chat_sft.Conversation(rec, "test")


def test_sft_rendering_is_the_servers(k3_tokenizer):
  """Each assistant turn: the ids before it are the server's prompt for the conversation so
  far (template.render), the masked ids from there are what the server's parser reads back
  as that very message (reasoning, content, tool calls), and the mask is exactly those."""
  tok = k3_tokenizer
  ids, mask = chat_sft.render(tok, _conv(AGENTIC, TOOLS))
  ids, mask = ids.tolist(), mask.tolist()
  t = chat.template_for(tok)
  assert isinstance(t, chat.K3Template)
  gen_open = [tok.special_tokens["<|open|>"]] + tok.encode("think") + \
      [tok.special_tokens["<|sep|>"]]             # the prompt's opened think channel
  eom = tok.special_tokens["<|end_of_msg|>"]
  want_mask = [False] * len(ids)
  for j, m in enumerate(AGENTIC):
    if m["role"] != "assistant":
      continue
    prompt = t.render(AGENTIC[:j], tools=TOOLS)
    p = prompt.ids
    assert ids[:len(p)] == p, f"turn {j}: the SFT ids differ from the server's prompt"
    assert p[-len(gen_open):] == gen_open
    start, end = len(p) - len(gen_open), ids.index(eom, len(p)) + 1
    back = chat.parse_assistant(t, prompt, ids[len(p):end])
    assert back["content"] == m["content"]
    assert back["reasoning_content"] == m["reasoning_content"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in back.get("tool_calls", [])] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"]))
         for c in m.get("tool_calls", [])]
    want_mask[start:end] = [True] * (end - start)
  assert mask == want_mask
  assert ids == chat.render_conversation(tok, AGENTIC, TOOLS)[0]     # no second renderer


def test_reasoning_kept_and_learnt_in_every_turn(k3_tokenizer):
  """Preserved thinking: every assistant turn keeps its think channel (an empty one when it
  has no reasoning; `reasoning` is read as reasoning_content), and the loss mask covers each
  turn's think and response, never a user turn; thinking false renders no think channel."""
  multi = MULTI + [{"role": "user", "content": "And 3+3?"},
                   {"role": "assistant", "content": "6", "reasoning": "ALIAS-REASONING"},
                   {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]
  ids, mask = chat_sft.render(k3_tokenizer, _conv(multi))
  text = k3_tokenizer.decode(ids.tolist())
  for r in ("OLD-REASONING", "NEW-REASONING", "ALIAS-REASONING"):
    assert f"<|open|>think<|sep|>{r}<|close|>think<|sep|>" in text
  assert text.count("<|open|>think<|sep|><|close|>think<|sep|>") == 1       # the last turn
  eom = k3_tokenizer.special_tokens["<|end_of_msg|>"]
  ends = [i for i, t in enumerate(ids.tolist()) if t == eom]
  turns = [k3_tokenizer.decode(ids[a + 1:b + 1].tolist()) for a, b in zip([-1] + ends, ends)]
  spans = [k3_tokenizer.decode(ids[a + 1:b + 1][mask[a + 1:b + 1]].tolist())
           for a, b in zip([-1] + ends, ends)]
  for m, turn, learnt in zip(multi, turns, spans):
    if m["role"] == "user":
      assert learnt == ""
    else:
      reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
      assert learnt == (f"<|open|>think<|sep|>{reasoning}<|close|>think<|sep|><|open|>response"
                        f"<|sep|>{m['content']}<|close|>response<|sep|><|close|>message<|sep|>"
                        "<|end_of_msg|>")
      assert turn == '<|open|>message role="assistant"<|sep|>' + learnt
  ids, _ = chat_sft.render(k3_tokenizer, _conv(MULTI, thinking=False))
  assert "think" not in k3_tokenizer.decode(ids.tolist())


def test_bad_conversations_are_one_line_errors(k3_tokenizer, tmp_path):
  with pytest.raises(UserError, match="test: a conversation with no assistant turn"):
    chat_sft.render(k3_tokenizer, _conv([{"role": "user", "content": "hi"}]))
  with pytest.raises(UserError, match="no K3 special tokens"):
    chat_sft.render(tokenizers.ByteTokenizer(), _conv(AGENTIC, TOOLS))
  with pytest.raises(UserError, match="test: messages\\[0\\] needs a role"):
    chat_sft.render(k3_tokenizer, _conv([{"content": "x"}]))
  p = tmp_path / "c.jsonl"
  p.write_text(json.dumps({"messages": MULTI}) + "\n" + json.dumps({"text": "x"}) + "\n")
  with pytest.raises(UserError, match="c.jsonl:2: expected a JSON object with a 'messages'"):
    chat_sft.read_jsonl(str(p))
  # the plain template (a byte tokenizer) renders a conversation without K3-only parts
  ids, mask = chat_sft.render(tokenizers.ByteTokenizer(), _conv(
      [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]))
  assert bytes(ids[mask].tolist()) == b"yo\n"


def test_too_long_conversations_are_dropped_with_a_count(small_tok):
  convs = [_conv(MULTI), _conv(AGENTIC, TOOLS), _conv(MULTI)]
  n_multi = len(chat_sft.render(small_tok, convs[0])[0])
  assert len(chat_sft.render(small_tok, convs[1])[0]) > n_multi
  warned = []
  chat_sft.chat_data("d", convs, [], small_tok, n_multi - 1, 2, 0, 1, warn=warned.append)
  assert any("dropped 1 of 3 conversations longer than seq_len + 1" in w for w in warned)
  with pytest.raises(UserError, match="every conversation \\(3\\) is longer"):
    chat_sft.chat_data("d", convs, [], small_tok, 8, 2, 0, 1, warn=warned.append)


def _tiny_model(vocab):
  cfg = apply_overrides(configs.get("k3_tiny"), [f"vocab_size={vocab}", "num_layers=4",
                                                  "mla_layers=(2,4)", "dense_layers=(1,)"])
  from k3_jax.model import create_model
  return nnx.split(create_model(cfg, seed=3), nnx.Param, ...)


def test_packing_keeps_conversations_apart(small_tok):
  """Three conversations packed in one row: segment ids 1, 2, 3 over each one's ids in turn,
  the loss mask is the shifted assistant mask inside a segment and 0 across boundaries and
  padding, and the packed batch's loss is the sum of each conversation's loss alone (with
  one segment over the whole row instead, it is not)."""
  convs = [_conv(MULTI), _conv(AGENTIC[1:3]), _conv(MULTI[:2], thinking=False)]
  rendered = [chat_sft.render(small_tok, c) for c in convs]
  seq = 512
  assert sum(len(i) for i, _ in rendered) <= seq + 1
  examples = [{"tokens": i, "mask": m.astype(np.int32)} for i, m in rendered]
  batch = next(chat_sft.make_chat_dataset(examples, seq, 1, seed=0, shuffle=False))
  seg, inp, tgt, lm = (batch[k][0] for k in ("segment_ids", "inputs", "targets", "loss_mask"))
  pos = 0
  for k, (ids, m) in enumerate(rendered, start=1):
    n = len(ids)
    span = slice(pos, pos + n - 1)                # inputs whose target is in the same piece
    assert (seg[pos:pos + n] == k).all() if pos + n <= seq else (seg[pos:] == k).all()
    assert (inp[pos:pos + n][:seq - pos] == ids[:seq - pos]).all()
    assert (lm[span] == m[1:]).all() and (tgt[span] == np.where(m[1:], ids[1:], 0)).all()
    if pos + n - 1 < seq:
      assert lm[pos + n - 1] == 0                 # no target across the boundary
    pos += n
  assert (seg[pos:] == 0).all() and (lm[pos:] == 0).all()
  assert lm.sum() == sum(int(m[1:].sum()) for _, m in rendered)

  graphdef, params, rest = _tiny_model(small_tok.vocab_size)
  loss = jax.jit(lambda b: train.loss_terms(graphdef, params, rest, b)[:2])
  packed_sum, packed_n = loss(batch)
  alone = []
  for ex in examples:
    b = next(chat_sft.make_chat_dataset([ex], seq, 1, seed=0, shuffle=False, num_epochs=1))
    alone.append(loss(b))
  assert float(packed_n) == sum(float(n) for _, n in alone)
  want = sum(float(s) for s, _ in alone)
  np.testing.assert_allclose(float(packed_sum), want, rtol=2e-5)
  leaky = dict(batch, segment_ids=np.where(batch["segment_ids"] > 0, 1, 0).astype(np.int32))
  assert abs(float(loss(leaky)[0]) - want) > 20 * 2e-5 * want    # far outside the tolerance


def _chat_file(path, n):
  rng = np.random.default_rng(0)
  lines = []
  for i in range(n):
    a, b = int(rng.integers(0, 100)), int(rng.integers(0, 100))
    msgs = [{"role": "user", "content": f"#{i}: {a}+{b}?"},
            {"role": "assistant", "content": str(a + b), "reasoning_content": f"add {a} {b}"}]
    lines.append(json.dumps({"messages": msgs, **({"tools": TOOLS} if i % 7 == 0 else {})}))
  path.write_text("\n".join(lines) + "\n")
  return str(path)


@pytest.mark.parametrize("fmt", ["arrayrecord", "parquet"])
def test_prepared_chat_dir_gives_the_jsonl_batches(small_tok, tmp_path, fmt):
  """The same train batches (3 of them) and eval batches from the .jsonl and from its
  prepared directory (3 shards), for each of 2 processes; resume is exact."""
  src = _chat_file(tmp_path / "chats.jsonl", 60)
  out = str(tmp_path / "prepared")
  m = prepare.prepare(src, out, "byte", fmt, num_shards=3, progress=False)
  assert m["kind"] == "messages" and m["splits"]["eval"]["documents"] == [2]
  cfg = apply_overrides(configs.get("k3_tiny"), [f"vocab_size={small_tok.vocab_size}"])
  tc = dataclasses.replace(configs.get_train("k3_tiny"), seq_len=128, batch_size=4,
                           eval_batches=2, tokenizer=small_tok.source)
  for proc in range(2):
    got = {}
    for name, ds in (("jsonl", src), ("dir", out)):
      it, evals = datasets.train_data(cfg, dataclasses.replace(tc, dataset=ds), proc, 2,
                                      warn=lambda m: None)
      got[name] = ([next(it) for _ in range(3)], evals, it)
    (a, ea, it_a), (b, eb, it_b) = got["jsonl"], got["dir"]
    assert len(ea) == len(eb) == 1 and a[0]["inputs"].shape == (2, 128)
    for x, y in zip(a + ea, b + eb):
      for k in x:
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)
    assert a[0]["loss_mask"].sum() > 0
    state = it_a.get_state()
    nxt = next(it_a)
    it_c, _ = datasets.train_data(cfg, dataclasses.replace(tc, dataset=out), proc, 2,
                                  warn=lambda m: None)
    it_c.set_state(state)
    for k, v in next(it_c).items():
      np.testing.assert_array_equal(v, nxt[k])
  # a different process gets different rows
  it0, _ = datasets.train_data(cfg, dataclasses.replace(tc, dataset=src), 0, 2, lambda m: None)
  it1, _ = datasets.train_data(cfg, dataclasses.replace(tc, dataset=src), 1, 2, lambda m: None)
  assert not np.array_equal(next(it0)["inputs"], next(it1)["inputs"])
