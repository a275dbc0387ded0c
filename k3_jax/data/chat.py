"""Chat templates: messages -> prompt token ids, and generated ids -> content, reasoning and
tool calls.

K3 format ("XTML", docs/architecture.md section 9), used when the tokenizer has the special
tokens `<|open|>`, `<|close|>`, `<|sep|>` and `<|end_of_msg|>`. Everything is a block

    <|open|>TAG ATTRS<|sep|>BODY<|close|>TAG<|sep|>      ATTRS: key="value" (& and " escaped)

and BLOCKS below is the one description of them that rendering and parsing both use. A message
is a `message` block with a role, followed by `<|end_of_msg|>`:

    <|open|>message role="user"<|sep|>{content}<|close|>message<|sep|><|end_of_msg|>

An assistant message holds the channels `think` (reasoning), `response` (content) and
optionally `tools` (`call` blocks with `tool` and `index` attributes holding `argument` blocks
with `key` and `type`; a string argument's body is the raw text, any other type JSON).
Generation starts after `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>`
(thinking) or `...<|open|>response<|sep|>` (instant) and stops at `<|end_of_msg|>`.

Choices the released description leaves open (docs/architecture.md section 9): tool
definitions go first, as a system message whose body is a `tools` block holding the OpenAI
`tools` array as JSON; a reasoning effort other than the default max goes before them as a
system message `reasoning_effort: low|high`; an assistant turn before the last user message
is rendered without its think channel (its reasoning is dropped), turns after it (an agentic
turn still in progress: assistant -> tool -> assistant) keep theirs; instant mode renders no
think channel. tool_choice "none" renders no tools; "required" and a named function put the
start of the call into the generation prompt (after an empty think and response), so the
model writes a call.

Plain format (byte-level presets, no special tokens), documented in docs/serving.md:

    <|system|>\n{content}\n<|user|>\n{content}\n<|assistant|>\n{content}\n ... <|assistant|>\n

with the stop string "\n<|user|>" (the model would start the next user turn); no reasoning.

Images (a model with a vision tower): a user message's content may be a list of OpenAI
content parts, {"type": "text", "text": ...} and {"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}. An image part becomes the media tokens and placeholders of
data/images.image_token_ids where it stands; Rendered.images holds the packed images (at most
vision.max_patches patches per request). Only data URLs are accepted: nothing is fetched.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from k3_jax.config import VisionConfig
from k3_jax.data import images as im

EFFORTS = ("low", "high", "max")
ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
  """Malformed messages (the server answers 400)."""


def _image_part(part: dict, where: str, role: str, vision: VisionConfig | None):
  """An image_url content part -> (patches, grid) of data/images.to_patches."""
  if vision is None:
    raise ChatError(f"{where}: this model has no vision tower; it cannot take images")
  if role != "user":
    raise ChatError(f"{where}: images are accepted in user messages only")
  ref = part.get("image_url")
  url = ref.get("url") if isinstance(ref, dict) else ref
  try:
    return im.to_patches(im.decode_data_url(url, f"{where}.image_url"), vision)
  except im.ImageError as e:
    raise ChatError(str(e)) from None


def _content(m: dict, i: int, vision: VisionConfig | None) -> list:
  """A message's content -> pieces: text (adjacent parts joined) and (patches, grid) images."""
  content = m.get("content") or ""
  if isinstance(content, str):
    return [content]
  if not isinstance(content, list):
    raise ChatError(f"messages[{i}].content must be a string or a list of content parts")
  pieces = [""]
  for j, part in enumerate(content):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
      if isinstance(pieces[-1], str):
        pieces[-1] += part["text"]
      else:
        pieces.append(part["text"])
    elif kind == "image_url":
      pieces.append(_image_part(part, f"messages[{i}].content[{j}]", m["role"], vision))
    else:
      raise ChatError(f"messages[{i}].content[{j}]: expected a {{\"type\": \"text\", \"text\": "
                      f"...}} or {{\"type\": \"image_url\", ...}} part, got {str(part)[:60]}")
  return pieces


def _check(messages, vision: VisionConfig | None = None) -> list[dict]:
  """Validated messages; each content becomes a list of pieces (see _content)."""
  if not isinstance(messages, list) or not messages:
    raise ChatError("messages must be a non-empty list")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ROLES:
      raise ChatError(f"messages[{i}] needs a role, one of {', '.join(ROLES)}")
    out.append({**m, "content": _content(m, i, vision)})
  return out


class _Prompt:
  """Prompt ids built piece by piece: runs of text are encoded together (so a text-only
  prompt encodes exactly as one string), images become their media tokens + placeholders.
  `mask` marks the ids written while `train` is set (the assistant's own tokens)."""

  def __init__(self, tokenizer, vision: VisionConfig | None):
    self.tok, self.vision = tokenizer, vision
    self.ids: list[int] = []
    self.mask: list[bool] = []
    self.images: list = []
    self.text = ""
    self.train = False

  def add(self, *pieces) -> "_Prompt":
    for p in pieces:
      if isinstance(p, str):
        self.text += p
      else:
        self.tokens(im.image_token_ids(p[1], self.vision, self.tok.encode))
        self.images.append(p)
    return self

  def tokens(self, ids) -> "_Prompt":
    if self.text:
      new = self.tok.encode(self.text)
      self.ids += new
      self.mask += [self.train] * len(new)
      self.text = ""
    ids = list(ids)
    self.ids += ids
    self.mask += [self.train] * len(ids)
    return self

  def training(self, on: bool) -> "_Prompt":
    self.tokens([])
    self.train = on
    return self

  def rendered(self, **kw) -> "Rendered":
    self.tokens([])
    packed = None
    if self.images:
      try:
        packed = im.pack_images(self.images, self.vision,
                                max_total_patches=self.vision.max_patches)
      except im.ImageError as e:
        raise ChatError(f"messages: {e} (vision.max_patches, per request)") from None
    return Rendered(self.ids, images=packed, mask=self.mask, **kw)


# ----- the K3 block table ------------------------------------------------------------------

MARKERS = {"open": "<|open|>", "close": "<|close|>", "sep": "<|sep|>",
           "eom": "<|end_of_msg|>"}


@dataclasses.dataclass(frozen=True)
class Block:
  tag: str
  attrs: tuple[str, ...] = ()        # attribute names, in the order they are written
  inside: tuple[str, ...] = ()       # the blocks it may hold ("message": its channels)
  field: str | None = None           # where the parser puts its text: reasoning / content /
                                     # argument (None: no text of its own)


BLOCKS = {b.tag: b for b in (
    Block("message", ("role",), ("think", "response", "tools")),
    Block("think", field="reasoning"),
    Block("response", field="content"),
    Block("tools", inside=("call",)),
    Block("call", ("tool", "index"), ("argument",)),
    Block("argument", ("key", "type"), field="argument"),
)}

ARG_TYPES = ("string", "number", "boolean", "null", "object", "array")


def escape_attr(v: str) -> str:
  return v.replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(v: str) -> str:
  return v.replace("&quot;", '"').replace("&amp;", "&")


def header(tag: str, **attrs) -> str:
  """The text between <|open|> and <|sep|>: TAG key="value" ... in BLOCKS' attribute order."""
  spec = BLOCKS[tag]
  extra = set(attrs) - set(spec.attrs)
  if extra:
    raise ValueError(f"block {tag!r} has no attributes {sorted(extra)}")
  parts = [tag] + [f'{k}="{escape_attr(str(attrs[k]))}"' for k in spec.attrs if k in attrs]
  return " ".join(parts)


_ATTR = re.compile(r'\s*([A-Za-z_][\w-]*)="([^"]*)"')


def parse_header(text: str) -> tuple[str, dict]:
  """header() reversed; unknown text after the tag is ignored attribute by attribute."""
  text = text.strip()
  tag, _, rest = text.partition(" ")
  return tag, {m.group(1): unescape_attr(m.group(2)) for m in _ATTR.finditer(rest)}


def arg_type(v) -> str:
  if isinstance(v, str):
    return "string"
  if isinstance(v, bool):
    return "boolean"
  if isinstance(v, (int, float)):
    return "number"
  if v is None:
    return "null"
  return "object" if isinstance(v, dict) else "array"


def arg_body(v) -> str:
  return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def _special_ids(tokenizer) -> dict | None:
  special = getattr(tokenizer, "special_tokens", None) or {}
  if not all(t in special for t in MARKERS.values()):
    return None
  return {k: special[t] for k, t in MARKERS.items()}


@dataclasses.dataclass
class Rendered:
  ids: list[int]
  stop: tuple[str, ...] = ()          # stop strings
  stop_ids: tuple[int, ...] = ()
  thinking: bool = False              # generation starts in the think channel
  images: dict | None = None          # packed images for the placeholders (data/images.py)
  mask: list[bool] | None = None      # per id: written by the assistant (chat SFT targets)
  start: tuple = ()                   # K3: the open blocks where generation starts
  tools: bool = False                 # K3: parse tool calls out of the output


def _tool_calls(m: dict, i: int) -> list[tuple[str, dict]]:
  """An assistant message's tool_calls -> [(name, arguments dict)]."""
  out = []
  calls = m.get("tool_calls") or []
  if not isinstance(calls, list):
    raise ChatError(f"messages[{i}].tool_calls must be a list")
  for j, c in enumerate(calls):
    fn = c.get("function") if isinstance(c, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
      raise ChatError(f"messages[{i}].tool_calls[{j}] needs function.name")
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
      try:
        args = json.loads(args)
      except json.JSONDecodeError:
        raise ChatError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid "
                        "JSON") from None
    if not isinstance(args, dict):
      raise ChatError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON "
                      "object")
    out.append((name, args))
  return out


def check_tools(tools) -> list[dict]:
  """OpenAI `tools` -> the list (each {"type": "function", "function": {"name": ...}})."""
  if tools is None:
    return []
  if not isinstance(tools, list):
    raise ChatError("tools must be a list of {\"type\": \"function\", \"function\": {...}}")
  for j, t in enumerate(tools):
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
        or not isinstance(fn.get("name"), str) or not fn["name"]:
      raise ChatError(f"tools[{j}] must be {{\"type\": \"function\", \"function\": "
                      "{\"name\": ..., \"parameters\": ...}}")
  return tools


def tool_choice_name(tool_choice, tools: list[dict]):
  """tool_choice -> "none" | "auto" | "required" | a function name (checked against tools)."""
  if tool_choice is None:
    return "auto" if tools else "none"
  if tool_choice in ("none", "auto", "required"):
    if tool_choice != "none" and not tools:
      raise ChatError(f"tool_choice={tool_choice!r} needs tools")
    return tool_choice
  fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
  name = fn.get("name") if isinstance(fn, dict) else None
  if not isinstance(name, str):
    raise ChatError("tool_choice must be \"none\", \"auto\", \"required\" or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}")
  if name not in [t["function"]["name"] for t in tools]:
    raise ChatError(f"tool_choice names the function {name!r}, which is not in tools")
  return name


class K3Template:
  name = "k3"

  def __init__(self, tokenizer, ids: dict, vision: VisionConfig | None = None):
    self.tok, self.sp, self.vision = tokenizer, ids, vision

  def _open(self, out: _Prompt, tag: str, **attrs) -> _Prompt:
    return out.tokens([self.sp["open"]]).add(header(tag, **attrs)).tokens([self.sp["sep"]])

  def _close(self, out: _Prompt, tag: str) -> _Prompt:
    return out.tokens([self.sp["close"]]).add(tag).tokens([self.sp["sep"]])

  def _block(self, out: _Prompt, tag: str, *pieces, **attrs) -> None:
    self._open(out, tag, **attrs).add(*pieces)
    self._close(out, tag)

  def _message(self, out: _Prompt, role: str, *pieces) -> None:
    self._block(out, "message", *pieces, role=role)
    out.tokens([self.sp["eom"]])

  def _calls(self, out: _Prompt, calls) -> None:
    self._open(out, "tools")
    for k, (name, args) in enumerate(calls):
      self._open(out, "call", tool=name, index=k + 1)
      for key, v in args.items():
        self._block(out, "argument", arg_body(v), key=key, type=arg_type(v))
      self._close(out, "call")
    self._close(out, "tools")

  def _conversation(self, messages, thinking, effort, tools) -> tuple[_Prompt, list]:
    messages = _check(messages, self.vision)
    effort = effort or "max"
    if effort not in EFFORTS:
      raise ChatError(f"reasoning_effort={effort!r} must be one of {', '.join(EFFORTS)}")
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = _Prompt(self.tok, self.vision)
    if thinking and effort != "max":
      self._message(out, "system", f"reasoning_effort: {effort}")
    if tools:
      self._open(out, "message", role="system")
      self._block(out, "tools", json.dumps(tools, ensure_ascii=False))
      self._close(out, "message")
      out.tokens([self.sp["eom"]])
    for i, m in enumerate(messages):
      if m["role"] != "assistant":
        self._message(out, m["role"], *m["content"])
        continue
      calls = _tool_calls(m, i)
      self._open(out, "message", role="assistant")
      out.training(True)
      reasoning = m.get("reasoning_content") or ""
      if thinking and i > last_user:         # kept only inside the current turn
        self._block(out, "think", reasoning)
      self._block(out, "response", *m["content"])
      if calls:
        self._calls(out, calls)
      self._close(out, "message")
      out.tokens([self.sp["eom"]])
      out.training(False)
    return out, messages

  def render(self, messages, thinking: bool = True, effort: str | None = None,
             tools=None, tool_choice=None) -> Rendered:
    tools = check_tools(tools)
    choice = tool_choice_name(tool_choice, tools)
    out, _ = self._conversation(messages, thinking, effort, tools if choice != "none" else [])
    self._open(out, "message", role="assistant")
    start = [("message", {"role": "assistant"})]
    if choice in ("none", "auto"):
      channel = "think" if thinking else "response"
      self._open(out, channel)
      start.append((channel, {}))
    else:                                     # forced: the call starts in the prompt
      if thinking:
        self._block(out, "think", "")
      self._block(out, "response", "")
      self._open(out, "tools")
      start.append(("tools", {}))
      if choice != "required":
        self._open(out, "call", tool=choice, index=1)
        start.append(("call", {"tool": choice, "index": "1"}))
    return out.rendered(stop_ids=(self.sp["eom"],), thinking=thinking, start=tuple(start),
                        tools=choice != "none")

  def render_conversation(self, messages, tools=None, thinking: bool = True,
                          effort: str | None = None) -> tuple[list[int], list[bool]]:
    out, _ = self._conversation(messages, thinking, effort, check_tools(tools))
    r = out.rendered()
    return r.ids, r.mask

  def parser(self, rendered: "Rendered | bool") -> "MessageParser":
    if isinstance(rendered, bool):
      rendered = Rendered([], thinking=rendered, start=(
          ("message", {"role": "assistant"}), ("think" if rendered else "response", {})),
          tools=True)
    return MessageParser(self.tok, self.sp, rendered.start, rendered.tools)


@dataclasses.dataclass
class Delta:
  reasoning: str = ""
  content: str = ""
  tool_calls: list = dataclasses.field(default_factory=list)   # completed calls, OpenAI form

  def __iter__(self):                 # (reasoning, content), as before tool calls existed
    return iter((self.reasoning, self.content))


class MessageParser:
  """Generated ids -> reasoning, content and tool calls, incrementally, through BLOCKS.

  Works on ids, not on decoded text, so a marker is a marker only when the model wrote the
  special token (the literal text "<|open|>" in an answer stays text). add(ids) returns a
  Delta of the new reasoning / content text and the tool calls completed in these ids."""

  def __init__(self, tok, sp: dict, start, tools: bool = True):
    self.tok, self.sp, self.tools = tok, sp, tools
    self.stack = [(t, dict(a)) for t, a in start]
    self.decoder = tok.stream_decoder()
    self.reading: tuple[str, list[int]] | None = None     # ("open"|"close", header ids)
    self.calls: list[dict] = []
    self.call: dict | None = None
    self.arg: list[str] | None = None
    for tag, attrs in self.stack:
      self._opened(tag, attrs)

  def _field(self) -> str | None:
    return BLOCKS[self.stack[-1][0]].field if self.stack and self.stack[-1][0] in BLOCKS \
        else None

  def _text(self, d: Delta, text: str) -> None:
    """Text goes to the innermost block's field; text between blocks is dropped."""
    f = self._field()
    if not text or f is None:
      return
    if f == "reasoning":
      d.reasoning += text
    elif f == "content":
      d.content += text
    elif self.arg is not None:
      self.arg.append(text)

  def _opened(self, tag: str, attrs: dict) -> None:
    if tag == "call":
      self.call = {"name": attrs.get("tool", ""), "args": {}}
    elif tag == "argument":
      self.arg = []

  def _closed(self, d: Delta, tag: str, attrs: dict) -> None:
    if tag == "argument" and self.call is not None and self.arg is not None:
      body, kind = "".join(self.arg), attrs.get("type", "string")
      if kind == "string":
        value = body
      else:
        try:
          value = json.loads(body)
        except json.JSONDecodeError:
          value = body                       # not JSON after all: kept as the text written
      self.call["args"][attrs.get("key", "")] = value
      self.arg = None
    elif tag == "call" and self.call is not None:
      if self.tools and self.call["name"]:
        c = {"index": len(self.calls), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": self.call["name"],
                          "arguments": json.dumps(self.call["args"], ensure_ascii=False)}}
        self.calls.append(c)
        d.tool_calls.append(c)
      self.call = None

  def add(self, ids) -> Delta:
    d = Delta()
    for t in ids:
      t = int(t)
      if self.reading is not None:
        if t == self.sp["sep"]:
          self._header_done(d)
          continue
        if t in (self.sp["open"], self.sp["close"], self.sp["eom"]):
          self.reading = None                     # a malformed header: dropped
        else:
          self.reading[1].append(t)
          continue
      if t in (self.sp["open"], self.sp["close"]):
        self._text(d, self.decoder.flush())
        self.reading = ("open" if t == self.sp["open"] else "close", [])
      elif t == self.sp["eom"]:
        self._text(d, self.decoder.flush())
      elif t != self.sp["sep"]:                   # a stray <|sep|> is dropped
        self._text(d, self.decoder.add(t))
    return d

  def _header_done(self, d: Delta) -> None:
    kind, hid = self.reading
    self.reading = None
    tag, attrs = parse_header(self.tok.decode(hid))
    if kind == "open":
      self.stack.append((tag, attrs))
      self._opened(tag, attrs)
      return
    if tag not in [s[0] for s in self.stack]:
      return                                      # closes nothing that is open: ignored
    while self.stack:                             # close up to the matching block
      top, top_attrs = self.stack.pop()
      self._closed(d, top, top_attrs)
      if top == tag:
        break

  def flush(self) -> Delta:
    """The rest of the text; a call still open (the output was cut off by max_tokens) is
    closed with the arguments complete so far, so a forced call always comes back."""
    d = Delta()
    self._text(d, self.decoder.flush())
    if self.call is not None:
      while self.stack:
        top, top_attrs = self.stack.pop()
        self._closed(d, top, top_attrs)
        if top == "call":
          break
    return d


ChannelParser = MessageParser


def parse_assistant(template: "K3Template", rendered: Rendered, ids) -> dict:
  """Generated ids -> an OpenAI assistant message (content, reasoning_content, tool_calls)."""
  p = template.parser(rendered)
  a, b = p.add(ids), p.flush()
  msg = {"role": "assistant", "content": a.content + b.content}
  if rendered.thinking:
    msg["reasoning_content"] = a.reasoning + b.reasoning
  if p.calls:
    msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in p.calls]
  return msg


class PlainTemplate:
  name = "plain"
  STOP = "\n<|user|>"

  def __init__(self, tokenizer, vision: VisionConfig | None = None):
    self.tok, self.vision = tokenizer, vision

  def _conversation(self, messages, effort, tools) -> _Prompt:
    messages = _check(messages, self.vision)
    if effort is not None and effort not in EFFORTS:
      raise ChatError(f"reasoning_effort={effort!r} must be one of {', '.join(EFFORTS)}")
    if tools or any(m.get("tool_calls") for m in messages):
      raise ChatError("tools: this model's tokenizer has no K3 special tokens, and tool calls "
                      "need the K3 chat format (serve a model directory with its tokenizer)")
    out = _Prompt(self.tok, self.vision)
    for m in messages:
      out.add(f"<|{m['role']}|>\n")
      out.training(m["role"] == "assistant").add(*m["content"], "\n").training(False)
    return out

  def render(self, messages, thinking: bool = False, effort: str | None = None,
             tools=None, tool_choice=None) -> Rendered:
    if tool_choice not in (None, "none", "auto"):
      raise ChatError("tool_choice: this model's chat format (plain) has no tool calls")
    out = self._conversation(messages, effort, tools)
    return out.add("<|assistant|>\n").rendered(stop=(self.STOP,))

  def render_conversation(self, messages, tools=None, thinking: bool = False,
                          effort: str | None = None) -> tuple[list[int], list[bool]]:
    r = self._conversation(messages, effort, tools).rendered()
    return r.ids, r.mask

  def parser(self, rendered):
    return None


def template_for(tokenizer, vision: VisionConfig | None = None):
  """The K3 template when the tokenizer has its special tokens, else the plain one. vision:
  the model's tower (ModelConfig.vision), without which image parts are refused."""
  ids = _special_ids(tokenizer)
  return K3Template(tokenizer, ids, vision) if ids else PlainTemplate(tokenizer, vision)


def render_conversation(tokenizer, messages, tools=None, thinking: bool = True,
                        effort: str | None = None, vision: VisionConfig | None = None
                        ) -> tuple[list[int], list[bool]]:
  """A whole conversation (no generation prompt) -> (ids, assistant_mask): mask[i] is True
  where ids[i] is the assistant's own writing (K3: everything after an assistant message's
  `<|open|>message role="assistant"<|sep|>` up to and including its `<|end_of_msg|>`; plain:
  the assistant content and its newline), the targets of chat fine-tuning."""
  return template_for(tokenizer, vision).render_conversation(messages, tools, thinking, effort)


__all__ = ["template_for", "K3Template", "PlainTemplate", "MessageParser", "ChannelParser",
           "ChatError", "Rendered", "BLOCKS", "Delta", "render_conversation",
           "parse_assistant", "check_tools", "tool_choice_name"]
