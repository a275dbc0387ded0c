"""Structured outputs: constrained decoding with llguidance (docs/serving.md, Structured
outputs and tool calls).

A `Constraint` is the per-request object of the engine's seam (Request.constraint):
`allowed()` -> bool[model vocab] (True: may be sampled next), `advance(token_id)`,
`is_done()`. The engine masks the disallowed ids of that slot to -inf before each sampling
and finishes the request (finish_reason "stop") once `is_done()`.

What is constrained:
- `response_format` {"type": "json_object"} (any JSON object) and {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}} (JSON valid against the schema), written
  compactly in json.dumps' default style (", " and ": ", no other whitespace: a model cannot
  pad forever). On the K3 chat template the grammar covers the rest of the assistant
  message as chat.py renders it: the reasoning (free text, thinking mode), `<|close|>think
  <|sep|><|open|>response<|sep|>`, the JSON, `<|close|>response<|sep|><|close|>message<|sep|>
  <|end_of_msg|>`. On the plain template and on /v1/completions the output is the JSON
  alone, then the end-of-text id (allowed only where the JSON is complete).
- tool_choice "required" or a named function on the K3 template: the prompt already opens
  the tools channel (and, named, the call block: chat.K3Template.render); the grammar
  covers exactly one well-formed call block as chat.py renders it (`call` header with the
  tool name and index="1", one `argument` block per parameter with its key and type, a
  string's body raw, any other type JSON valid against the parameter's schema), then the
  closing of the tools channel and message and `<|end_of_msg|>`. Required parameters come
  in the schema's order, optional ones may be left out; other keys are not written.

The llguidance tokenizer is built from each id's bytes (`token_bytes`): the byte tokenizer,
a tiktoken BPE (Kimi's tiktoken.model) or a Hugging Face tokenizer.json alike. Special tokens,
ids no token names and ids past the tokenizer's vocabulary (up to the model's vocab_size)
are special to llguidance, so no text rule ever matches them: they are allowed only where a
grammar names them by id (`<[id]>`, the K3 markers), never otherwise.

Why llguidance (not xgrammar): it has no Python dependencies at all (xgrammar 0.2.9's wheel
requires torch, transformers and triton), it takes the vocabulary as plain token byte
strings (no transformers tokenizer object needed), its masks are computed lazily per step
from the lexer/Earley state, so a new schema costs milliseconds to compile with no
per-grammar precomputation over the vocabulary (every request brings its own schema), and its Lark front end names special
tokens by id and embeds JSON schemas (`%json {...}`), which is what the K3 tool-call and
message grammars need.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from k3_jax.data import tokenizers as tk

# JSON as json.dumps writes it by default; nothing else (no free whitespace).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
  """A schema or combination the constraint cannot be built for (the server answers 400
  naming `param`)."""

  def __init__(self, message: str, param: str = "response_format"):
    super().__init__(message)
    self.param = param


# ----- the llguidance tokenizer ----------------------------------------------------------

def _hf_piece_bytes(tok, i: int) -> bytes | None:
  """A non-byte-level `tokenizers` token's bytes: `<0xNN>` byte fallback, `▁` = space."""
  piece = tok._tok.id_to_token(i)              # pylint: disable=protected-access
  if piece is None:
    return None
  if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
    try:
      return bytes([int(piece[3:5], 16)])
    except ValueError:
      pass
  return piece.replace("\u2581", " ").encode()


def token_bytes(tokenizer, vocab_size: int) -> tuple[list[bytes], list[int]]:
  """(bytes of each id 0..vocab_size-1, the ids that are special to llguidance). Special:
  the tokenizer's special tokens, its EOS, and every id no token names (their bytes are
  their placeholder names, which text rules never match since they are marked special)."""
  special = set(int(i) for i in (getattr(tokenizer, "special_tokens", None) or {}).values())
  if tokenizer.eos_id is not None:
    special.add(int(tokenizer.eos_id))
  out: list[bytes | None] = [None] * vocab_size
  n = min(int(tokenizer.vocab_size), vocab_size)
  if isinstance(tokenizer, tk.ByteTokenizer):
    for i in range(n):
      out[i] = bytes([i])
  elif isinstance(tokenizer, tk.TiktokenTokenizer):
    for b, i in tokenizer.ranks.items():
      if i < vocab_size:
        out[i] = b
  elif isinstance(tokenizer, tk.HFTokenizer):
    if tokenizer._byte_level:                   # pylint: disable=protected-access
      for i, b in tokenizer._bytes.items():     # pylint: disable=protected-access
        if i < vocab_size:
          out[i] = b
    else:
      for i in range(n):
        out[i] = _hf_piece_bytes(tokenizer, i)
  else:
    for i in range(n):
      out[i] = tokenizer.decode_bytes([i])
  names = {i: name for name, i in (getattr(tokenizer, "special_tokens", None) or {}).items()}
  for i in range(vocab_size):
    if i in special or not out[i]:
      special.add(i)
      out[i] = names.get(i, tk.reserved_name(i)).encode()
  return out, sorted(special)


class _Wrapped:
  """What llguidance.TokenizerWrapper reads: tokens, eos / bos ids, special ids, encode."""

  def __init__(self, tokenizer, vocab_size: int):
    self._tok = tokenizer
    self.tokens, self.special_token_ids = token_bytes(tokenizer, vocab_size)
    eos = tokenizer.eos_id
    self.eos_token_id = int(eos) if eos is not None else self.special_token_ids[-1]
    self.bos_token_id = tokenizer.bos_id

  def __call__(self, s) -> list[int]:
    return list(self._tok.encode(s.decode("utf-8", errors="replace")
                                 if isinstance(s, bytes) else s))


_LL_LOCK = threading.Lock()
_LL_CACHE: dict = {}


def ll_tokenizer(tokenizer, vocab_size: int):
  """The llguidance tokenizer of `tokenizer` over the model's vocabulary (cached: building
  it walks every id)."""
  import llguidance as llg  # pylint: disable=g-import-not-at-top
  key = (id(tokenizer), int(vocab_size))
  with _LL_LOCK:
    hit = _LL_CACHE.get(key)
    if hit is None or hit[0] is not tokenizer:
      hit = (tokenizer, llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped(tokenizer, vocab_size)),
                                        n_vocab=int(vocab_size)))
      _LL_CACHE[key] = hit
    return hit[1]


# ----- the constraint ----------------------------------------------------------------------

class Constraint:
  """One request's grammar state (Request.constraint). stop_ids: ids that end the output
  but that the grammar does not name (the end-of-text id): allowed only where the grammar
  accepts, and consuming one is the end."""

  def __init__(self, lltok, grammar: str, vocab_size: int, stop_ids=(), what: str = ""):
    import llguidance as llg  # pylint: disable=g-import-not-at-top
    self.what = what
    self.vocab_size = int(vocab_size)
    self.matcher = llg.LLMatcher(lltok, grammar, log_level=0)
    if self.matcher.is_error():
      raise GrammarError(f"{what}: {self.matcher.get_error()}")
    self.stop_ids = np.asarray(sorted(set(int(i) for i in stop_ids)), np.int64)
    self._stop_set = set(self.stop_ids.tolist())
    self.tokens: list[int] = []
    self.done = False
    self.error: str | None = None

  def allowed(self) -> np.ndarray:
    if self.done:
      out = np.zeros((self.vocab_size,), bool)
      out[self.stop_ids] = True
      return out
    bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
    out = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
    if out.size < self.vocab_size:
      out = np.concatenate([out, np.zeros((self.vocab_size - out.size,), bool)])
    if self.stop_ids.size:
      out[self.stop_ids] = self.matcher.is_accepting()
    return out

  def advance(self, token_id: int) -> None:
    token_id = int(token_id)
    self.tokens.append(token_id)
    if self.done:
      return
    if token_id in self._stop_set:
      if not self.matcher.is_accepting():
        self.error = f"stop id {token_id} before the grammar accepts"
      self.done = True
      return
    if not self.matcher.consume_token(token_id):
      self.error = self.matcher.get_error() or f"token {token_id} not allowed"
      self.done = True

  def is_done(self) -> bool:
    return self.done or self.matcher.is_stopped()

  def is_complete(self) -> bool:
    """Whether what was generated so far is a complete sentence of the grammar."""
    return self.error is None and (self.matcher.is_accepting() or self.matcher.is_stopped())


# ----- grammars ------------------------------------------------------------------------------

def _lit(s: str) -> str:
  """A Lark string literal of s."""
  return json.dumps(s, ensure_ascii=False)


def _json_rule(schema: dict) -> str:
  """`%json {...}` of schema with JSON_OPTIONS (through its x-guidance key)."""
  return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def check_schema(schema, lltok, what: str, param: str = "response_format") -> None:
  """GrammarError naming `what` when llguidance cannot compile the schema (an unsupported
  keyword, a contradiction, ...)."""
  import llguidance as llg  # pylint: disable=g-import-not-at-top
  if not isinstance(schema, dict):
    raise GrammarError(f"{what} must be a JSON object (a JSON Schema)", param)
  g = llg.LLMatcher.grammar_from_lark(f"start: {_json_rule(schema)}\n")
  err = llg.LLMatcher.validate_grammar(g, lltok)
  if err and not err.startswith("WARNING"):
    raise GrammarError(f"{what} is not a JSON Schema this server can enforce: {err}", param)


def response_schema(response_format) -> dict | None:
  """The JSON Schema a validated `response_format` (api_schema.ResponseFormat) asks for
  (None for text or none)."""
  kind = (response_format or {}).get("type")
  if kind == "json_object":
    return {"type": "object"}
  if kind == "json_schema":
    return response_format["json_schema"].get("schema", {})
  return None


class K3Marks:
  """The K3 markers as Lark terminals naming their ids."""

  def __init__(self, sp: dict):
    self.sp = sp

  def __getattr__(self, k):
    return f"<[{self.sp[k]}]>"

  def open(self, header: str) -> str:
    return f"{self.__getattr__('open')} {_lit(header)} {self.sep}"

  def close(self, tag: str) -> str:
    return f"{self.__getattr__('close')} {_lit(tag)} {self.sep}"


def k3_message_grammar(sp: dict, start, schema: dict) -> str:
  """The rest of a K3 assistant message from the generation start of `start` (chat.Rendered
  .start: think or response opened) holding JSON valid against schema in its response."""
  m = K3Marks(sp)
  channel = start[-1][0] if start else "response"
  tail = f"{m.close('response')} {m.close('message')} {m.eom}"
  if channel == "think":
    return (f"start: THINK {m.close('think')} {m.open('response')} body {tail}\n"
            f"body: {_json_rule(schema)}\n"
            "THINK: /(?s:.*)/\n")
  if channel == "response":
    return f"start: body {tail}\nbody: {_json_rule(schema)}\n"
  raise GrammarError(f"response_format: the generation starts in the {channel!r} block")


def plain_grammar(schema: dict) -> str:
  return f"start: {_json_rule(schema)}\n"


_JSON_TYPES = {"integer": "number", "number": "number", "boolean": "boolean", "null": "null",
               "object": "object", "array": "array", "string": "string"}


def _arg_type(schema: dict, where: str) -> str:
  """chat.arg_type of every value `schema` allows (the argument block's type attribute)."""
  if not isinstance(schema, dict):
    raise GrammarError(f"{where} must be a JSON Schema object", "tools")
  t = schema.get("type")
  if isinstance(t, str) and t in _JSON_TYPES:
    return _JSON_TYPES[t]
  values = schema.get("enum") if "enum" in schema else (
      [schema["const"]] if "const" in schema else None)
  if values:
    from k3_jax.data.chat import arg_type  # pylint: disable=g-import-not-at-top
    kinds = {arg_type(v) for v in values}
    if len(kinds) == 1:
      return kinds.pop()
  raise GrammarError(f"{where}: a forced tool call needs each parameter to have one JSON "
                     "type (\"type\": \"string\" | \"number\" | ..., or an enum of one type)",
                     "tools")


def _string_body(schema: dict) -> str:
  """A Lark rule body for a string argument's raw text (no JSON quoting)."""
  values = schema.get("enum") if "enum" in schema else (
      [schema["const"]] if "const" in schema else None)
  if values:
    return " | ".join(_lit(v) for v in values)
  if "pattern" in schema:
    return "/" + schema["pattern"].replace("/", "\\/") + "/"
  lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
  rep = f"{{{lo},{int(hi)}}}" if hi is not None else (f"{{{lo},}}" if lo else "*")
  return f"/(?s:.{rep})/"


def _call_rules(m: K3Marks, fn: dict, k: int, rules: list[str]) -> str:
  """Rules for the arguments of one function; returns the name of its arguments rule."""
  from k3_jax.data.chat import header  # pylint: disable=g-import-not-at-top
  params = fn.get("parameters") or {"type": "object", "properties": {}}
  where = f"tools[{k}].function.parameters"
  if not isinstance(params, dict) or params.get("type", "object") != "object":
    raise GrammarError(f"{where} must be an object schema", "tools")
  props = params.get("properties") or {}
  if not isinstance(props, dict):
    raise GrammarError(f"{where}.properties must be an object", "tools")
  required = params.get("required") or []
  parts = []
  for j, (key, sub) in enumerate(props.items()):
    kind = _arg_type(sub, f"{where}.properties.{key}")
    body = _string_body(sub) if kind == "string" else _json_rule(sub)
    rules.append(f"a{k}_{j}: {m.open(header('argument', key=key, type=kind))} a{k}_{j}_body "
                 f"{m.close('argument')}")
    rules.append(f"a{k}_{j}_body: {body}")
    parts.append(f"a{k}_{j}" if key in required else f"a{k}_{j}?")
  rules.append(f"args{k}: {' '.join(parts)}" if parts else f'args{k}: ""')
  return f"args{k}"


def tool_call_grammar(sp: dict, tools: list[dict], choice: str, start=()) -> str:
  """The rest of a K3 assistant message that is one call (tool_choice `choice`: "required",
  any of the tools; a name, that function) from the generation start of `start`
  (chat.Rendered.start): free reasoning if the think channel is open, an empty response,
  then the tools channel holding the call, then the message's end."""
  from k3_jax.data.chat import header  # pylint: disable=g-import-not-at-top
  m = K3Marks(sp)
  rules: list[str] = []
  channel = start[-1][0] if start else "response"
  if channel not in ("think", "response"):
    raise GrammarError(f"tool_choice: the generation starts in the {channel!r} block",
                       "tool_choice")
  head = f"{m.close('response')} {m.open('tools')}"
  if channel == "think":
    head = f"THINK {m.close('think')} {m.open('response')} {head}"
    rules.append("THINK: /(?s:.*)/")
  alts = []
  for k, t in enumerate(tools):
    name = t["function"]["name"]
    if choice not in ("required", name):
      continue
    args = _call_rules(m, t["function"], k, rules)
    rules.append(f"call{k}: {m.open(header('call', tool=name, index=1))} {args} "
                 f"{m.close('call')}")
    alts.append(f"call{k}")
  rules.insert(0, f"start: {head} ({' | '.join(alts)}) {m.close('tools')} "
               f"{m.close('message')} {m.eom}")
  return "\n".join(rules) + "\n"


# ----- what the server builds --------------------------------------------------------------

def for_chat(template, rendered, body: dict, vocab_size: int) -> Constraint | None:
  """The constraint of a chat request (None: unconstrained). `template` is chat.py's,
  `rendered` its Rendered for the request. GrammarError (400) for what cannot be enforced."""
  from k3_jax.data.chat import K3Template, check_tools, tool_choice_name  # pylint: disable=g-import-not-at-top
  schema = response_schema(body.get("response_format"))
  tools = check_tools(body.get("tools"))
  choice = tool_choice_name(body.get("tool_choice"), tools)
  forced = choice not in ("none", "auto")
  if schema is None and not forced:
    return None
  if schema is not None and forced:
    raise GrammarError("response_format together with tool_choice "
                       f"{body.get('tool_choice')!r} is not supported: a forced call is the "
                       "whole answer", "response_format")
  lltok = ll_tokenizer(template.tok, vocab_size)
  if isinstance(template, K3Template):
    if forced:
      g, what = tool_call_grammar(template.sp, tools, choice, rendered.start), "tool_choice"
    else:
      check_schema(schema, lltok, "response_format.json_schema.schema")
      g, what = k3_message_grammar(template.sp, rendered.start, schema), "response_format"
    return _build(lltok, g, vocab_size, (), what)
  if forced:
    raise GrammarError("tool_choice: this model's chat format (plain) has no tool calls",
                       "tool_choice")
  check_schema(schema, lltok, "response_format.json_schema.schema")
  return _build(lltok, plain_grammar(schema), vocab_size,
                tuple(rendered.stop_ids) + _eos(template.tok), "response_format")


def for_completion(tokenizer, body: dict, vocab_size: int) -> Constraint | None:
  """The constraint of a /v1/completions request with response_format (None: none): the
  completion is the JSON, then the end-of-text id."""
  schema = response_schema(body.get("response_format"))
  if schema is None:
    return None
  lltok = ll_tokenizer(tokenizer, vocab_size)
  check_schema(schema, lltok, "response_format.json_schema.schema")
  return _build(lltok, plain_grammar(schema), vocab_size, _eos(tokenizer), "response_format")


def _eos(tokenizer) -> tuple[int, ...]:
  return () if tokenizer.eos_id is None else (int(tokenizer.eos_id),)


def _build(lltok, grammar: str, vocab_size: int, stop_ids, what: str) -> Constraint:
  import llguidance as llg  # pylint: disable=g-import-not-at-top
  g = llg.LLMatcher.grammar_from_lark(grammar)
  err = llg.LLMatcher.validate_grammar(g, lltok)
  if err and not err.startswith("WARNING"):
    raise GrammarError(f"{what}: cannot be enforced: {err}",
                       "tools" if what == "tool_choice" else what)
  return Constraint(lltok, g, vocab_size, stop_ids, what)


__all__ = ["GrammarError", "Constraint", "ll_tokenizer", "token_bytes", "response_schema",
           "check_schema", "k3_message_grammar", "plain_grammar", "tool_call_grammar",
           "for_chat", "for_completion", "JSON_OPTIONS"]
