"""Constrained decoding (k3_jax/serve/grammar.py) without a model: constraints walked with
random allowed tokens must end in outputs that satisfy their grammar (JSON valid against the
schema; a K3 tool call that chat.MessageParser parses back with arguments of the schema's
types), and ids the grammar does not name (reserved ids, ids past the tokenizer, the end of
text before the JSON is complete) are never allowed."""

import json

import jsonschema
import numpy as np
import pytest

from k3_jax.data import tokenizers as tk
from k3_jax.data import chat
from k3_jax.serve import grammar as gm

K3_VOCAB = tk.K3_VOCAB_SIZE
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "hourly": {"type": "boolean"}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "say", "parameters": {
        "type": "object", "properties": {"words": {"type": "array", "maxItems": 2,
                                                   "items": {"type": "integer",
                                                             "minimum": 0, "maximum": 9}}},
        "required": ["words"]}}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def walk(c, rng, limit=400, vocab_limit=None):
  """Random allowed tokens until the constraint is done -> the ids."""
  out = []
  for _ in range(limit):
    a = c.allowed()
    assert a.dtype == bool and a.shape == (c.vocab_size,)
    if vocab_limit is not None:
      assert not a[vocab_limit:].any()
    ids = np.flatnonzero(a)
    assert ids.size, f"nothing allowed after {out}"
    t = int(rng.choice(ids))
    out.append(t)
    c.advance(t)
    if c.is_done():
      assert c.is_complete() and c.error is None
      return out
  pytest.fail(f"not done after {limit} tokens")


def json_format(schema):
  return {"response_format": {"type": "json_schema",
                              "json_schema": {"name": "out", "schema": schema, "strict": True}}}


def test_byte_json_schema_walks_validate():
  """The byte tokenizer, /v1/completions form: the JSON, then the end of text (NUL) only
  where the JSON is complete; ids past the 256 bytes (a larger model vocab) never."""
  tok = tk.ByteTokenizer()
  rng = np.random.default_rng(0)
  for _ in range(12):
    c = gm.for_completion(tok, json_format(SCHEMA), 300)
    out = walk(c, rng, vocab_limit=256)
    text = tok.decode([t for t in out if t != tok.eos_id])
    assert tok.eos_id not in out[:-1]
    jsonschema.validate(json.loads(text), SCHEMA)
  c = gm.for_completion(tok, json_format(SCHEMA), 300)
  assert not c.allowed()[tok.eos_id]                 # the empty output is not JSON
  for t in b'{"name": "x", "age": 7, "ok": true, "tags": []':
    assert c.allowed()[t]
    c.advance(t)
  a = c.allowed()
  assert a[ord(",")] and a[ord("}")] and not a[ord("x")]     # the optional "unit", or the end
  assert not a[tok.eos_id] and not c.is_done()
  c.advance(ord("}"))
  assert c.is_done() and c.is_complete()


def test_k3_json_schema_in_the_response_channel(k3_tokenizer):
  """K3 template, instant and thinking: the grammar covers the rest of the assistant message
  as chat.py renders it; the parsed content validates; the K3 reserved ids never appear."""
  t = chat.template_for(k3_tokenizer)
  rng = np.random.default_rng(1)
  for seed in range(6):
    r = t.render(ASK, thinking=False)
    c = gm.for_chat(t, r, json_format(SCHEMA), K3_VOCAB)
    out = walk(c, rng)
    assert out[-1] == t.sp["eom"]
    assert not any(tk.K3_NUM_BASE_TOKENS <= i < K3_VOCAB and i not in t.sp.values()
                   for i in out)
    msg = chat.parse_assistant(t, r, out[:-1])
    jsonschema.validate(json.loads(msg["content"]), SCHEMA)
  # thinking: free reasoning first; walked here by hand to the end of the think channel
  r = t.render(ASK, thinking=True)
  c = gm.for_chat(t, r, {"response_format": {"type": "json_object"}}, K3_VOCAB)
  ids = k3_tokenizer.encode("Let me think.")
  ids += [t.sp["close"]] + k3_tokenizer.encode("think") + [t.sp["sep"], t.sp["open"]]
  ids += k3_tokenizer.encode("response") + [t.sp["sep"]] + k3_tokenizer.encode('{"a": [1]}')
  ids += [t.sp["close"]] + k3_tokenizer.encode("response") + [t.sp["sep"], t.sp["close"]]
  ids += k3_tokenizer.encode("message") + [t.sp["sep"]]
  for i in ids:
    assert c.allowed()[i], (i, k3_tokenizer.decode([i]))
    c.advance(i)
  assert np.flatnonzero(c.allowed()).tolist() == [t.sp["eom"]]
  c.advance(t.sp["eom"])
  assert c.is_done() and c.is_complete()
  assert chat.parse_assistant(t, r, ids) == {"role": "assistant", "content": '{"a": [1]}',
                                              "reasoning_content": "Let me think."}
  c = gm.for_chat(t, t.render(ASK, thinking=False), {"response_format": {
      "type": "json_object"}}, K3_VOCAB)
  assert not c.allowed()[k3_tokenizer.encode("[")[0]]          # an object, not an array


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_tool_call_parses_back(k3_tokenizer, choice):
  """tool_choice required / named: after the release's prompt (which opens the think or the
  response channel), the walk is an empty response and exactly one well-formed call block
  (then the message's end) that MessageParser turns into tool_calls whose arguments validate
  against the function's parameters; the named choice always calls that function. Thinking:
  free reasoning first (walked by hand to the end of the think channel)."""
  t = chat.template_for(k3_tokenizer)
  rng = np.random.default_rng(2)
  names = set()
  think = k3_tokenizer.encode("Plan.") + [t.sp["close"]] + k3_tokenizer.encode("think") + \
      [t.sp["sep"]]
  for k in range(8):
    thinking = k % 2 == 1
    r = t.render(ASK, tools=TOOLS, tool_choice=choice, thinking=thinking)
    c = gm.for_chat(t, r, {"tools": TOOLS, "tool_choice": choice}, K3_VOCAB)
    head = think if thinking else []
    for i in head:
      assert c.allowed()[i]
      c.advance(i)
    out = head + walk(c, rng)
    assert out[-1] == t.sp["eom"]
    msg = chat.parse_assistant(t, r, out[:-1])
    assert msg["content"] == "" and msg.get("reasoning_content", "Plan.") == "Plan."
    (call,) = msg["tool_calls"]
    fn = next(x["function"] for x in TOOLS if x["function"]["name"] == call["function"]["name"])
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, {**fn["parameters"], "additionalProperties": False})
    names.add(fn["name"])
  assert names == ({"get_weather", "say"} if choice == "required" else {"get_weather"})


def test_hf_tokenizer_has_the_same_token_bytes(k3_tokenizer, tmp_path):
  """The same vocabulary through a Hugging Face tokenizer.json (save_hf_tokenizer) gives the
  constraint the same bytes per id and the same special ids."""
  tk.save_hf_tokenizer(k3_tokenizer, tmp_path)
  (tmp_path / "tiktoken.model").unlink()
  hf = tk.get_tokenizer(str(tmp_path))
  assert isinstance(hf, tk.HFTokenizer)
  a, sa = gm.token_bytes(k3_tokenizer, K3_VOCAB)
  b, sb = gm.token_bytes(hf, K3_VOCAB)
  assert a == b and sa == sb
  assert set(k3_tokenizer.special_tokens.values()) <= set(sa)


def test_bad_formats_and_combinations():
  tok = tk.ByteTokenizer()
  from k3_jax.serve.api_schema import CompletionRequest, parse   # the shape: the request model
  from k3_jax.serve.api_params import ParamError
  for rf, needle in (({"type": "xml"}, "expected a 'type'"),
                     ({"type": "json_schema"}, "json_schema is required"),
                     ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
                      "name"),
                     ({"type": "json_schema", "json_schema": {"name": "a", "schema": []}},
                      "schema"),
                     ("json", "response_format")):
    with pytest.raises(ParamError, match=needle) as e:
      parse(CompletionRequest, {"prompt": "x", "response_format": rf})
    assert e.value.param == "response_format"
  with pytest.raises(gm.GrammarError, match="JSON Schema") as e:    # the schema: llguidance
    gm.for_completion(tok, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "nonsense"}}}}, 256)
  assert e.value.param == "response_format"
  assert gm.for_completion(tok, {"response_format": {"type": "text"}}, 256) is None
  plain = chat.template_for(tok)
  with pytest.raises(gm.GrammarError, match="plain"):
    gm.for_chat(plain, plain.render(ASK), {"tools": TOOLS, "tool_choice": "required"}, 256)


def test_forced_call_refusals(k3_tokenizer):
  t = chat.template_for(k3_tokenizer)
  r = t.render(ASK, tools=TOOLS, tool_choice="required")
  with pytest.raises(gm.GrammarError, match="tool_choice"):
    gm.for_chat(t, r, {"tools": TOOLS, "tool_choice": "required",
                       "response_format": {"type": "json_object"}}, K3_VOCAB)
  odd = [{"type": "function", "function": {"name": "f", "parameters": {
      "type": "object", "properties": {"x": {"anyOf": [{"type": "string"},
                                                       {"type": "integer"}]}}}}}]
  with pytest.raises(gm.GrammarError, match=r"properties\.x") as e:
    gm.for_chat(t, t.render(ASK, tools=odd, tool_choice="required"),
                {"tools": odd, "tool_choice": "required"}, K3_VOCAB)
  assert e.value.param == "tools"
  assert gm.for_chat(t, t.render(ASK, tools=TOOLS), {"tools": TOOLS}, K3_VOCAB) is None
