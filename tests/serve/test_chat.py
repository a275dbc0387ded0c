"""Chat templates: the K3 channel format (with a byte-level BPE carrying K3's special
tokens) and the plain template of the byte presets."""

import pytest
import tiktoken

from k3_jax.data.tokenizers import ByteTokenizer, TiktokenTokenizer
from k3_jax.serve.chat import ChatError, K3Template, PlainTemplate, template_for

SPECIAL = {"<|open|>": 256, "<|sep|>": 257, "<|close|>": 258, "<|eom|>": 259}


@pytest.fixture(scope="module")
def k3_tok():
  enc = tiktoken.Encoding("bytes+k3", pat_str=r"[\s\S]", special_tokens=SPECIAL,
                          mergeable_ranks={bytes([i]): i for i in range(256)})
  return TiktokenTokenizer(enc, eos_id=259)


def show(tok, ids):
  inv = {v: k for k, v in SPECIAL.items()}
  return "".join(inv.get(i) or tok.decode([i]) for i in ids)


def test_k3_template_render(k3_tok):
  t = template_for(k3_tok)
  assert isinstance(t, K3Template)
  msgs = [{"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4", "reasoning_content": "old thoughts"},
          {"role": "user", "content": "and 3+3?"},
          {"role": "assistant", "content": "", "reasoning_content": "call a tool"},
          {"role": "tool", "content": "6"}]
  r = t.render(msgs, thinking=True, effort="high")
  text = show(k3_tok, r.ids)
  assert text == (
      "<|open|>system<|sep|>reasoning_effort: high<|close|>"
      "<|open|>user<|sep|>2+2?<|close|><|eom|>"
      "<|open|>response<|sep|>4<|close|><|eom|>"               # earlier turn: reasoning dropped
      "<|open|>user<|sep|>and 3+3?<|close|><|eom|>"
      "<|open|>think<|sep|>call a tool<|close|><|open|>response<|sep|><|close|><|eom|>"
      "<|open|>tool<|sep|>6<|close|><|eom|>"
      "<|open|>think<|sep|>")                                  # current turn: kept
  assert r.stop_ids == (259,)
  instant = show(k3_tok, t.render(msgs[:1], thinking=False).ids)
  assert instant == "<|open|>user<|sep|>2+2?<|close|><|eom|><|open|>response<|sep|>"
  with pytest.raises(ChatError, match="reasoning_effort"):
    t.render(msgs, effort="extreme")


def test_k3_parser_splits_channels(k3_tok):
  t = template_for(k3_tok)
  gen = (k3_tok.encode("let me think") + [258, 256] + k3_tok.encode("response") + [257]
         + k3_tok.encode("héllo") + [258, 259])
  p = t.parser(thinking=True)
  reasoning, content = "", ""
  for i in gen:                                   # one id at a time, as when streaming
    r, c = p.add([i])
    reasoning, content = reasoning + r, content + c
  r, c = p.flush()
  assert (reasoning + r, content + c) == ("let me think", "héllo")


def test_plain_template():
  t = template_for(ByteTokenizer())
  assert isinstance(t, PlainTemplate)
  r = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
  assert ByteTokenizer().decode(r.ids) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
  assert r.stop == ("\n<|user|>",)
  for bad in ([], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 3}]):
    with pytest.raises(ChatError):
      t.render(bad)


def test_image_parts_render_in_place(k3_tok):
  """An image part becomes its media tokens + placeholders where it stands (between the text
  parts around it), in the plain and the K3 template; its patches are what to_patches gives;
  a model without a tower refuses it."""
  import base64
  import io
  import numpy as np
  from PIL import Image
  import configs
  from k3_jax.data import images as im
  from k3_jax.serve.prefix_cache import block_hashes, image_salts
  v = configs.get_multimodal("k3_tiny").vision
  pixels = np.random.default_rng(0).integers(0, 256, (28, 56, 3), dtype=np.uint8)
  buf = io.BytesIO()
  Image.fromarray(pixels).save(buf, format="PNG")
  url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
  msg = [{"role": "user", "content": [{"type": "text", "text": "A "},
                                      {"type": "image_url", "image_url": {"url": url}},
                                      {"type": "text", "text": " B"}]}]
  tok = ByteTokenizer()
  patches, grid = im.to_patches(pixels, v)
  media = im.image_token_ids(grid, v, tok.encode)
  r = template_for(tok, v).render(msg)
  assert r.ids == tok.encode("<|user|>\nA ") + media + tok.encode(" B\n<|assistant|>\n")
  np.testing.assert_array_equal(r.images["patches"], patches)
  k3 = K3Template(k3_tok, {"open": 256, "sep": 257, "close": 258, "eom": 259}, v)
  ids = k3.render(msg, thinking=False).ids
  text_only = k3.render([{"role": "user", "content": "A  B"}], thinking=False).ids
  at = text_only.index(ord(" ")) + 1                   # between "A " and " B"
  assert ids == text_only[:at] + im.image_token_ids(grid, v, k3_tok.encode) + text_only[at:]
  with pytest.raises(ChatError, match="no vision tower"):
    template_for(tok).render(msg)
  # the prefix cache keys a block holding placeholders on the image's content
  other = dict(r.images, patches=r.images["patches"] + 1)
  salted = [block_hashes(r.ids, 16, image_salts(r.ids, x, v.image_token_id, 16))
            for x in (r.images, r.images, other)]
  assert salted[0] == salted[1] and salted[0][0] == block_hashes(r.ids, 16)[0]   # no image
  assert salted[0][-1] != salted[2][-1] and salted[0][-1] != block_hashes(r.ids, 16)[-1]
