"""Chat templates: messages -> prompt token ids, and generated ids -> (reasoning, content).

K3 format (docs/architecture.md section 9), used when the tokenizer has the special tokens `<|open|>`,
`<|sep|>`, `<|close|>` and an end-of-message token (`<|eom|>`, else the tokenizer's EOS):

    [<|open|>system<|sep|>reasoning_effort: {low|high|max}<|close|>]      (thinking only)
    <|open|>{role}<|sep|>{content}<|close|><|eom|>                 (system, user, tool)
    <|open|>think<|sep|>{reasoning}<|close|><|open|>response<|sep|>{content}<|close|><|eom|>
                                                                    (assistant)
    then the generation prompt: <|open|>think<|sep|> (thinking) or <|open|>response<|sep|>
    (instant).

Earlier turns' reasoning: an assistant turn BEFORE the last user message is rendered
without its think channel (its reasoning is dropped); assistant turns after the last user
message (an agentic turn still in progress: assistant -> tool -> assistant) keep theirs.
In instant mode no think channel is rendered at all.

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
  prompt encodes exactly as one string), images become their media tokens + placeholders."""

  def __init__(self, tokenizer, vision: VisionConfig | None):
    self.tok, self.vision = tokenizer, vision
    self.ids: list[int] = []
    self.images: list = []
    self.text = ""

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
      self.ids += self.tok.encode(self.text)
      self.text = ""
    self.ids += list(ids)
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
    return Rendered(self.ids, images=packed, **kw)


def _special_ids(tokenizer) -> dict | None:
  enc = getattr(tokenizer, "_encoding", None)
  special = getattr(enc, "_special_tokens", None) if enc is not None else None
  if not special or not all(t in special for t in ("<|open|>", "<|sep|>", "<|close|>")):
    return None
  eom = special.get("<|eom|>", getattr(tokenizer, "eos_id", None))
  if eom is None:
    return None
  return {"open": special["<|open|>"], "sep": special["<|sep|>"],
          "close": special["<|close|>"], "eom": eom}


@dataclasses.dataclass
class Rendered:
  ids: list[int]
  stop: tuple[str, ...] = ()          # stop strings
  stop_ids: tuple[int, ...] = ()
  thinking: bool = False              # generation starts in the think channel
  images: dict | None = None          # packed images for the placeholders (data/images.py)


class K3Template:
  name = "k3"

  def __init__(self, tokenizer, ids: dict, vision: VisionConfig | None = None):
    self.tok, self.sp, self.vision = tokenizer, ids, vision

  def _msg(self, out: _Prompt, channel: str, pieces) -> None:
    sp = self.sp
    out.tokens([sp["open"]]).add(channel).tokens([sp["sep"]]).add(*pieces).tokens([sp["close"]])

  def render(self, messages, thinking: bool = True, effort: str | None = None) -> Rendered:
    messages = _check(messages, self.vision)
    effort = effort or "max"
    if effort not in EFFORTS:
      raise ChatError(f"reasoning_effort={effort!r} must be one of {', '.join(EFFORTS)}")
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = _Prompt(self.tok, self.vision)
    if thinking:
      self._msg(out, "system", [f"reasoning_effort: {effort}"])
    for i, m in enumerate(messages):
      if m["role"] == "assistant":
        reasoning = m.get("reasoning_content") or ""
        if thinking and i > last_user and reasoning:      # kept only inside the current turn
          self._msg(out, "think", [reasoning])
        self._msg(out, "response", m["content"])
      else:
        self._msg(out, m["role"], m["content"])
      out.tokens([self.sp["eom"]])
    out.tokens([self.sp["open"]]).add("think" if thinking else "response").tokens([self.sp["sep"]])
    return out.rendered(stop_ids=(self.sp["eom"],), thinking=thinking)

  def parser(self, thinking: bool) -> "ChannelParser":
    return ChannelParser(self.tok, self.sp, "think" if thinking else "response")


class ChannelParser:
  """Generated ids -> text per channel, incrementally: add(ids) -> (reasoning, content)."""

  def __init__(self, tok, sp: dict, channel: str):
    self.tok, self.sp, self.channel = tok, sp, channel
    self.decoder = tok.stream_decoder()
    self.naming: list[int] | None = None      # ids of a channel name being read

  def add(self, ids) -> tuple[str, str]:
    out = {"think": "", "response": ""}
    for t in ids:
      if t == self.sp["open"]:
        out[self.channel] += self.decoder.flush()
        self.naming = []
      elif t == self.sp["sep"] and self.naming is not None:
        self.channel = "think" if self.tok.decode(self.naming).strip() == "think" else "response"
        self.naming = None
      elif self.naming is not None:
        self.naming.append(t)
      elif t in (self.sp["close"], self.sp["eom"]):
        out[self.channel] += self.decoder.flush()
      else:
        out[self.channel] += self.decoder.add(t)
    return out["think"], out["response"]

  def flush(self) -> tuple[str, str]:
    rest = self.decoder.flush()
    return (rest, "") if self.channel == "think" else ("", rest)


class PlainTemplate:
  name = "plain"
  STOP = "\n<|user|>"

  def __init__(self, tokenizer, vision: VisionConfig | None = None):
    self.tok, self.vision = tokenizer, vision

  def render(self, messages, thinking: bool = False, effort: str | None = None) -> Rendered:
    messages = _check(messages, self.vision)
    if effort is not None and effort not in EFFORTS:
      raise ChatError(f"reasoning_effort={effort!r} must be one of {', '.join(EFFORTS)}")
    out = _Prompt(self.tok, self.vision)
    for m in messages:
      out.add(f"<|{m['role']}|>\n", *m["content"], "\n")
    return out.add("<|assistant|>\n").rendered(stop=(self.STOP,))

  def parser(self, thinking: bool):
    return None


def template_for(tokenizer, vision: VisionConfig | None = None):
  """The K3 template when the tokenizer has its special tokens, else the plain one. vision:
  the model's tower (ModelConfig.vision), without which image parts are refused."""
  ids = _special_ids(tokenizer)
  return K3Template(tokenizer, ids, vision) if ids else PlainTemplate(tokenizer, vision)


__all__ = ["template_for", "K3Template", "PlainTemplate", "ChannelParser", "ChatError",
           "Rendered"]
