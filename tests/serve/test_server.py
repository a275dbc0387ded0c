"""The OpenAI-compatible server, as a subprocess on 127.0.0.1, driven by the `openai` client.

One server (module fixture): the 5-layer k3_tiny variant of test_engine.py with its tiny
vision tower and random weights, the byte tokenizer (plain chat template), 4 slots, a queue
bound of 16. Greedy decoding (temperature 0) is deterministic, so "correct" means: the same
text as the same request alone, and streamed deltas that add up to the non-streamed text;
with an image, the same tokens as one unpaged prefill of the whole prompt with the images,
then decode_step (the model's own path).
"""

import base64
import concurrent.futures
import io
import time

import httpx
import numpy as np
import openai
import pytest

from tests.serve.serverproc import start_server, stop_server

MODEL = "k3-test"
MAX_LEN = 2048
OVERRIDES = ("max_seq_len=2048", "num_layers=5", "mla_layers=(4,5)")
LAUNCH = """
from k3_jax.serve.loader import ServeOptions, run_server
from k3_jax.config import ServeConfig
run_server(ServeOptions(config="k3_tiny", overrides={overrides}, vision=True,
           seed=3, model_name="{model}",
           serve=ServeConfig(max_batch=4, max_queue=16, prefix_cache_bytes=1 << 22, warmup=False,
                             host="127.0.0.1", port={port})))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  proc, base, _ = start_server(LAUNCH, tmp_path_factory.mktemp("server"), model=MODEL,
                               overrides=OVERRIDES)
  try:
    yield base
  finally:
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def reference():
  """(cfg, model): the served model built again in this process (same preset, overrides and
  seed), for the tests' independent full forward passes (built once for the file)."""
  from flax import nnx
  from k3_jax.serve.loader import random_weights
  cfg, g, p, r = random_weights("k3_tiny", OVERRIDES, seed=3, vision=True)
  return cfg, nnx.merge(g, p, r)


def complete(client, prompt, n=8, **kw):
  return client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                   **kw)


def test_models_and_health(server, client):
  assert [m.id for m in client.models.list().data] == [MODEL]
  assert httpx.get(f"{server}/health", timeout=10).json()["status"] == "ok"


def test_completions_stream_and_usage(server, client):
  prompt = "def fibonacci(n):\n    "
  full = complete(client, prompt)
  assert full.choices[0].finish_reason in ("length", "stop")
  assert full.usage.prompt_tokens == len(prompt.encode())
  assert 1 <= full.usage.completion_tokens <= 8
  chunks = list(complete(client, prompt, stream=True, stream_options={"include_usage": True}))
  text = "".join(c.choices[0].text for c in chunks if c.choices)
  assert text == full.choices[0].text
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
      full.usage.completion_tokens
  # the raw stream ends with the [DONE] sentinel
  with httpx.stream("POST", f"{server}/v1/completions", timeout=120, json={
      "model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": True}) as r:
    lines = [l for l in r.iter_lines() if l]
  assert lines[-1] == "data: [DONE]" and all(l.startswith("data: ") for l in lines)


def test_chat_stream_and_not(client):
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Name a prime."}]
  full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                        temperature=0)
  msg = full.choices[0].message
  assert msg.role == "assistant" and full.usage.completion_tokens >= 1
  chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                               temperature=0, stream=True))
  assert chunks[0].choices[0].delta.role == "assistant"
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  assert text == msg.content
  assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_cached_tokens_on_shared_prefix(server, client):
  shared = "".join(chr(97 + (i * 7) % 26) for i in range(1024))     # 1,024 byte tokens
  first = complete(client, shared + " first question?", 4)
  second = complete(client, shared + " second one, longer?", 4)
  assert first.usage.prompt_tokens_details.cached_tokens == 0
  assert second.usage.prompt_tokens_details.cached_tokens == 1024
  # a hit gives what a cold prefill gives (the same request again, after the cache is warm)
  again = complete(client, shared + " first question?", 4)
  assert again.usage.prompt_tokens_details.cached_tokens == 1024
  assert again.choices[0].text == first.choices[0].text
  metrics = httpx.get(f"{server}/metrics", timeout=10).text
  hits = [l for l in metrics.splitlines() if l.startswith("k3_prefix_cache_hits_total")]
  assert hits and float(hits[0].split()[-1]) >= 2048
  ttft = [l for l in metrics.splitlines() if l.startswith("k3_time_to_first_token_seconds_count")]
  assert ttft and float(ttft[0].split()[-1]) >= 3


def texts(n):
  """n distinct prompts of 12 to 15 byte tokens: prefill pieces of 4 and 1 only, so that
  prompts arriving together share 2-row calls of shapes the file compiles anyway (the
  2-row 4- and 1-token pieces; a 16-token piece would add a 2-row 16-token shape)."""
  return [f"Req {i}: fox {i * 37}" for i in range(n)]


def test_sixteen_concurrent_clients(client):
  prompts = texts(16)
  alone = {p: complete(client, p, 6).choices[0].text for p in prompts[:4]}
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    outs = list(pool.map(lambda p: complete(client, p, 6), prompts))
  for p, o in zip(prompts, outs):
    assert o.usage.prompt_tokens == len(p.encode()) and o.usage.completion_tokens >= 1
    if p in alone:
      assert o.choices[0].text == alone[p]
  # and each concurrent answer equals that request alone
  for p, o in list(zip(prompts, outs))[4:8]:
    assert complete(client, p, 6).choices[0].text == o.choices[0].text


def error_of(resp):
  body = resp.json()
  assert set(body["error"]) >= {"message", "type", "param", "code"}
  return body["error"]


@pytest.mark.parametrize("payload,status,needle", [
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": "x" * 3000}, 400, "context"),
    ({"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": [2 ** 40], "max_tokens": 0, "echo": True, "logprobs": 1}, 400, "vocabulary"),
    ({"prompt": [65, 10 ** 6], "max_tokens": 0, "echo": True}, 400, "vocabulary"),
])
def test_bad_input(server, payload, status, needle):
  body = {"model": MODEL, "max_tokens": 2, **payload}
  r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
  assert r.status_code == status
  assert needle in error_of(r)["message"]


def test_malformed_json_and_messages(server):
  r = httpx.post(f"{server}/v1/completions", content=b"{not json", timeout=60,
                 headers={"content-type": "application/json"})
  assert r.status_code == 400 and "JSON" in error_of(r)["message"]
  r = httpx.post(f"{server}/v1/chat/completions", json={"model": MODEL, "messages": []},
                 timeout=60)
  assert r.status_code == 400 and "messages" in error_of(r)["message"]
  with pytest.raises(openai.NotFoundError):
    openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0).chat.completions.create(
        model="nope", messages=[{"role": "user", "content": "hi"}])
  assert httpx.get(f"{server}/health", timeout=10).json()["status"] == "ok"   # still up


@pytest.mark.parametrize("path,body,param", [
    ("completions", b'{"prompt": "ab\\udcffc", "max_tokens": 2}', "prompt"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
])
def test_lone_surrogate_is_400_naming_the_field(server, path, body, param):
  """JSON may escape half a UTF-16 pair; no tokenizer can encode it: a 400, not a 500."""
  r = httpx.post(f"{server}/v1/{path}", content=body, timeout=60,
                 headers={"content-type": "application/json"})
  assert r.status_code == 400, r.text
  err = error_of(r)
  assert "surrogate" in err["message"] and err["param"] == param


def test_openapi_serves_the_validating_schema(server):
  """The request schemas /openapi.json serves are those of the models that validate the
  bodies (api_schema), and a body one step past each limit of limits.py is a 400 from the
  server naming the field (test_limits: the same bodies against the served schema)."""
  from k3_jax.serve import api_schema as s
  from tests.serve.test_limits import at_and_past
  def same(x):        # (FastAPI leaves out the schema's "default": null entries)
    if isinstance(x, dict):
      return {k: same(v) for k, v in x.items() if not (k == "default" and v is None)}
    return [same(v) for v in x] if isinstance(x, list) else x

  spec = httpx.get(f"{server}/openapi.json", timeout=30).json()
  for path, model in (("/v1/completions", s.CompletionRequest),
                      ("/v1/chat/completions", s.ChatCompletionRequest),
                      ("/tokenize", s.TokenizeRequest), ("/detokenize", s.DetokenizeRequest)):
    want = s.request_body(model)
    assert same(spec["paths"][path]["post"]["requestBody"]) == same(want["requestBody"])
    for name, schema in want["x-components"].items():
      assert same(spec["components"]["schemas"][name]) == same(schema)
  for model, base, field, _, bad in at_and_past():
    path = "completions" if model is s.CompletionRequest else "chat/completions"
    r = httpx.post(f"{server}/v1/{path}", json={"model": MODEL, **base, **bad}, timeout=60)
    assert r.status_code == 400 and error_of(r)["param"] == field, (field, bad, r.text)


def health(server):
  return httpx.get(f"{server}/health", timeout=10).json()


def test_disconnect_frees_slot(server):
  with httpx.stream("POST", f"{server}/v1/completions", timeout=120, json={
      "model": MODEL, "prompt": "long story:", "max_tokens": 1500, "temperature": 0,
      "stream": True}) as r:
    for line in r.iter_lines():
      if line.startswith("data: {"):
        break                                   # one token arrived: hang up
  assert health(server)["running"] <= 1
  deadline = time.monotonic() + 30
  while health(server)["running"] and time.monotonic() < deadline:
    time.sleep(0.1)
  assert health(server)["running"] == 0 and health(server)["free_slots"] == 4


def test_queue_bound_429(server):
  body = {"model": MODEL, "prompt": "count:", "max_tokens": 60, "temperature": 0}

  def post(_):
    return httpx.post(f"{server}/v1/completions", json=body, timeout=300)

  with concurrent.futures.ThreadPoolExecutor(40) as pool:
    codes = [r.status_code for r in pool.map(post, range(40))]
  assert codes.count(429) >= 1 and codes.count(200) >= 4 and set(codes) <= {200, 429}
  r = httpx.post(f"{server}/v1/completions", json={**body, "max_tokens": 2}, timeout=60)
  assert r.status_code == 200                  # and it recovers


# ----- images in chat messages -------------------------------------------------------------

def data_url(pixels: np.ndarray, fmt: str = "PNG") -> str:
  from PIL import Image
  buf = io.BytesIO()
  Image.fromarray(pixels).save(buf, format=fmt)
  return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def picture(seed: int, h: int = 28, w: int = 56) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def image_message(urls, before: str = "", after: str = "?") -> list:
  """A user message: text, the images, text. Two small images of different shapes keep the
  prompt under 64 tokens (the prefill pieces other tests compiled) and every request on one
  packed shape (one tower compile)."""
  if isinstance(urls, str):
    urls = [urls]
  return [{"role": "user", "content": [
      {"type": "text", "text": before},
      *({"type": "image_url", "image_url": {"url": u}} for u in urls),
      {"type": "text", "text": after}]}]


def two_pictures(seed: int) -> list[str]:
  return [data_url(picture(seed)), data_url(picture(seed + 100, 56, 28))]


def test_chat_with_image_matches_a_full_forward(client, reference):
  """The served greedy tokens of an image prompt == greedy tokens of the model's own full
  forward pass (no cache; K3Model.__call__ runs the tower inside), one position at a time
  over a fixed-length padded sequence (causal: the padding after a position never reaches
  it). So the engine's chunked paged prefill, its separate tower call and its per-piece
  feature slicing change nothing."""
  import jax
  import jax.numpy as jnp
  from k3_jax.data.tokenizers import ByteTokenizer
  from k3_jax.data.chat import template_for

  messages = image_message(two_pictures(0))
  n = 6
  served = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n,
                                          temperature=0)
  cfg, model = reference
  tok = ByteTokenizer()
  rendered = template_for(tok, cfg.vision).render(messages)
  assert served.usage.prompt_tokens == len(rendered.ids)
  forward = jax.jit(lambda t, images: model(t, images=images)[0][0])
  seq = np.zeros((1, len(rendered.ids) + n), np.int32)
  seq[0, :len(rendered.ids)] = rendered.ids
  ids = []
  for k in range(n):
    at = len(rendered.ids) + k
    ids.append(int(jnp.argmax(forward(jnp.asarray(seq), rendered.images)[at - 1])))
    if ids[-1] == tok.eos_id or k == n - 1:
      break
    seq[0, at] = ids[-1]
  assert served.usage.completion_tokens == len(ids)
  assert served.choices[0].message.content == tok.decode([i for i in ids if i != tok.eos_id])
  # streamed, and batched with text requests: the same
  chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n,
                                               temperature=0, stream=True))
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
      served.choices[0].message.content
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    image = pool.submit(client.chat.completions.create, model=MODEL, messages=messages,
                        max_tokens=n, temperature=0)
    others = [pool.submit(complete, client, t, 6) for t in texts(3)]
    assert image.result().choices[0].message.content == served.choices[0].message.content
    assert all(o.result().usage.completion_tokens >= 1 for o in others)


def test_prefix_cache_keys_blocks_on_image_content(client):
  """Two images of one size give identical placeholder tokens: the second must not hit the
  first one's blocks (its image sits in block 0), while each repeated exactly hits 1,024
  tokens and answers what its cold run answered."""
  text = "".join(chr(97 + (i * 11) % 26) for i in range(1000))    # 1,024 + a short tail

  def ask(seed):
    return client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                          messages=image_message(two_pictures(seed), "", text))
  a, b = ask(10), ask(11)
  assert a.usage.prompt_tokens == b.usage.prompt_tokens > 1024
  assert a.usage.prompt_tokens_details.cached_tokens == 0
  assert b.usage.prompt_tokens_details.cached_tokens == 0      # other pixels: no reuse
  for seed, cold in ((10, a), (11, b)):
    hit = ask(seed)
    assert hit.usage.prompt_tokens_details.cached_tokens == 1024
    assert hit.choices[0].message.content == cold.choices[0].message.content


def test_bad_images_are_400(server):
  huge = data_url(np.zeros((896, 896, 3), np.uint8))        # 64 x 64 patches, resized to 1,024
  cases = [
      (image_message("https://example.com/cat.png"), "only data URLs"),
      (image_message("data:image/png;base64,@@not base64@@"), "not valid base64"),
      (image_message("data:image/png;base64," + base64.b64encode(b"hello").decode()),
       "not a readable image"),
      (image_message("data:text/plain;base64,aGVsbG8="), "not an image"),
      ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": huge}},
                                     {"type": "image_url", "image_url": {"url": huge}}]}],
       "beyond the patch budget"),
      ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
       "expected a"),
      ([{"role": "assistant", "content": [{"type": "image_url",
                                           "image_url": {"url": data_url(picture(1))}}]}],
       "user messages only"),
  ]
  for messages, needle in cases:
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert r.status_code == 400, (needle, r.text)
    assert needle in error_of(r)["message"] and error_of(r)["param"] == "messages"
  # placeholder ids smuggled into a text prompt (the byte vocabulary reserves 252-255)
  r = httpx.post(f"{server}/v1/completions", timeout=60,
                 json={"model": MODEL, "prompt": [65, 255, 66], "max_tokens": 2})
  assert r.status_code == 400 and "no images" in error_of(r)["message"]
  assert health(server)["status"] == "ok"                   # still up


def test_logprobs_echo_n_and_prompt_forms(server, client, reference):
  """logprobs are the log-softmax of the model's own logits: the echoed prompt's (scored
  teacher-forced) to 1e-5 against an independent full forward pass, the completion's (the
  engine's paged decode) to 1e-4 (its summation order differs: test_engine's REF_TOL). A
  greedy token is its row's argmax, so it tops its top_logprobs."""
  import jax
  from k3_jax.data.tokenizers import ByteTokenizer

  prompt = "The quick brown fox"
  ids = list(prompt.encode())
  scored = complete(client, prompt, 0, echo=True, logprobs=3)
  c = scored.choices[0]
  assert c.text == prompt and scored.usage.completion_tokens == 0
  lp = c.logprobs
  assert lp.tokens == list(prompt) and lp.text_offset == list(range(len(prompt)))
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  _, model = reference
  gen = complete(client, ids, 4, echo=True, logprobs=2)
  out = gen.choices[0]
  # the greedy continuation by the model's own full forward (padded: causal), as the
  # image test does
  forward = jax.jit(lambda t: model(t)[0][0])
  seq = np.zeros((1, len(ids) + 4), np.int32)
  seq[0, :len(ids)] = ids
  for at in range(len(ids), len(ids) + 4):
    seq[0, at] = int(np.argmax(forward(seq)[at - 1]))
  full = [int(t) for t in seq[0]]
  assert out.text == ByteTokenizer().decode(full) and len(out.logprobs.tokens) == len(full)
  logits = np.asarray(forward(seq), np.float64)
  want = logits - logits.max(-1, keepdims=True)
  want = want - np.log(np.exp(want).sum(-1, keepdims=True))
  ref = [None] + [want[i - 1, t] for i, t in enumerate(full) if i]
  np.testing.assert_allclose(lp.token_logprobs[1:], ref[1:len(ids)], atol=1e-5, rtol=0)
  np.testing.assert_allclose(out.logprobs.token_logprobs[1:], ref[1:], atol=1e-4, rtol=0)
  for i in range(len(ids), len(full)):
    top = out.logprobs.top_logprobs[i]
    assert len(top) == 2 and max(top.values()) == out.logprobs.token_logprobs[i]
    assert out.logprobs.text_offset[i] == sum(len(t) for t in out.logprobs.tokens[:i])
  # n samples with a seed: reproducible, distinct; a list of prompts: one choice per prompt
  # and sample, prompt-major; token-id lists alike
  kw = dict(model=MODEL, max_tokens=4, temperature=1.0, seed=11, n=2)
  a = client.completions.create(prompt=[prompt, "Hello"], **kw)
  b = client.completions.create(prompt=[ids, list(b"Hello")], **kw)
  assert [ch.index for ch in a.choices] == list(range(4))
  assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
  assert a.choices[0].text != a.choices[1].text
  assert a.usage.prompt_tokens == len(ids) + 5
  # streamed: the chunks' tokens and logprobs add up to the non-streamed choice
  chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=4,
                                          temperature=0, logprobs=1, stream=True))
  toks = [t for ch in chunks if ch.choices and ch.choices[0].logprobs
          for t in ch.choices[0].logprobs.token_logprobs]
  np.testing.assert_allclose(toks, out.logprobs.token_logprobs[len(ids):], atol=1e-6)
  for body, needle in (({"logprobs": 6}, "logprobs"), ({"n": 0}, "n"),
                       ({"max_tokens": 0}, "max_tokens"), ({"prompt": [[]]}, "empty"),
                       ({"prompt": [1, "a"]}, "prompt")):
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                      "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400 and needle in error_of(r)["message"]
