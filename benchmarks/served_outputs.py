"""The served outputs of a fixed request set, recorded and compared bitwise.

  python -m benchmarks.served_outputs --record out.npz     # before a change to serve/
  python -m benchmarks.served_outputs --check out.npz      # after it: every array equal

Not a timing: a guard for refactors of the serving engine and server that must not change
what is served. On the 5-layer k3_tiny variant of tests/serve (random weights, seed 3, the
byte tokenizer) it runs, through engines of several settings (overlap on and off, the prefix
cache with hits, a pool small enough to preempt, batched prefill), requests that exercise
greedy and seeded sampling, penalties, logit_bias, logprobs, stop ids and strings, forks
(n samples of one prefill) and a cancelled request; and through the HTTP app (in process)
completions with n / best_of / echo / logprobs / streaming and chat completions. It records
every request's tokens, logits (float32 bits), logprobs, text and finish reason, and every
HTTP response with its ids and timestamps blanked. `--check` lists every difference (for
HTTP answers, but for the two fields the engine thread's timing decides: see _timeless).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from k3_jax import train
from k3_jax.data.tokenizers import ByteTokenizer
from k3_jax.model import create_model
from k3_jax.serve.engine import Engine
from k3_jax.serve.requests import SamplingParams


def _cfg():
  import configs
  from k3_jax.config import apply_overrides, validate
  return validate(apply_overrides(configs.get("k3_tiny"), ["max_seq_len=2048", "num_layers=5",
                                                           "mla_layers=(4,5)"]))


def _prompt(seed, n):
  return np.random.default_rng(seed).integers(1, 256, n).astype(np.int32)


def _record(out: dict, name: str, r) -> None:
  out[f"{name}/ids"] = np.asarray(r.output_ids, np.int32)
  out[f"{name}/logits"] = (np.stack(r.logits).view(np.int32) if r.logits
                           else np.zeros((0,), np.int32))
  out[f"{name}/lp"] = np.asarray(r.token_logprobs, np.float64).view(np.int64)
  out[f"{name}/top"] = np.asarray([[v for pair in row for v in pair]
                                   for row in r.top_logprobs], np.float64).reshape(-1)
  out[f"{name}/meta"] = np.frombuffer(json.dumps(
      [r.text, r.finish_reason, r.error, int(r.cached_tokens)]).encode(), np.uint8)


def engine_runs(out: dict, weights) -> None:
  cfg, g, p, r = weights
  tok = ByteTokenizer()
  shared = _prompt(1, 700)
  reqs = [
      ("greedy", _prompt(2, 30), SamplingParams(max_tokens=12), {}),
      ("long", _prompt(3, 1100), SamplingParams(max_tokens=6), {}),
      ("hit_a", np.concatenate([shared, _prompt(4, 40)]), SamplingParams(max_tokens=5), {}),
      ("sampled", _prompt(5, 77), SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8,
                                                 seed=11, presence_penalty=0.5,
                                                 frequency_penalty=0.3), {}),
      ("bias_lp", _prompt(6, 19), SamplingParams(max_tokens=8, logit_bias=((65, 5.0),
                                                                           (66, -100.0)),
                                                 logprobs=3), {}),
      ("stops", _prompt(7, 50), SamplingParams(max_tokens=20, stop=("e", "zz"),
                                               stop_ids=(10,)), {}),
      ("hit_b", np.concatenate([shared, _prompt(8, 60)]), SamplingParams(max_tokens=5), {}),
  ]
  for tag, settings in (("overlap", dict(max_batch=4)),
                        ("sync", dict(max_batch=4, overlap=False)),
                        ("batched", dict(max_batch=4, batch_invariant=False,
                                         prefill_chunk=1024)),
                        ("tight", {})):
    if tag == "tight":       # a pool of 5 pages: the long requests preempt one another
      probe = Engine(cfg, g, p, r, max_batch=1, max_len=512, prefix_cache_bytes=0)
      settings = dict(max_batch=4, prefix_cache_bytes=0, kv_cache_bytes=6 * probe.page_bytes)
    eng = Engine(cfg, g, p, r, tokenizer=tok, **{"prefix_cache_bytes": 1 << 22, **settings})
    got = []
    extra = [] if tag != "tight" else [     # each crosses a page boundary while decoding
        (f"grow{i}", _prompt(20 + i, 505), SamplingParams(max_tokens=12), {}) for i in range(4)]
    for name, prompt, params, kw in extra + reqs:
      got.append((name, eng.submit(prompt, params, record_logits=True, **kw)))
    lead = eng.submit(_prompt(9, 45), SamplingParams(max_tokens=7, temperature=1.0, seed=3,
                                                     logprobs=2), record_logits=True)
    for j in range(1, 3):    # forks: more samples of lead's prefill
      got.append((f"fork{j}", eng.submit(_prompt(9, 45), SamplingParams(
          max_tokens=7, temperature=1.0, seed=3 + j, logprobs=2), record_logits=True,
          fork_of=lead)))
    got.append(("lead", lead))
    gone = eng.submit(_prompt(10, 20), SamplingParams(max_tokens=50))
    eng.step()
    gone.cancel()
    eng.run_until_done()
    later = eng.submit(np.concatenate([shared, _prompt(12, 33)]), SamplingParams(max_tokens=4),
                       record_logits=True)
    eng.run_until_done()
    got += [("cancelled", gone), ("later_hit", later)]
    for name, req in got:
      _record(out, f"engine/{tag}/{name}", req)
    out[f"engine/{tag}/counts"] = np.asarray(list(eng.resource_counts().values()))


def _blank(obj):
  if isinstance(obj, dict):
    return {k: ("-" if k in ("id", "created", "system_fingerprint") else _blank(v))
            for k, v in obj.items()}
  if isinstance(obj, list):
    return [_blank(v) for v in obj]
  return obj


def _merged(chunks: list, done: bool) -> list:
  """A stream's chunks joined per choice: its text (or delta fields) and logprobs lists
  concatenated, its last finish_reason; the usage chunk; whether [DONE] ended it."""
  per: dict = {}
  usage = None
  for c in chunks:
    if "error" in c:
      return [c, done]
    usage = c.get("usage") or usage
    for ch in c["choices"]:
      m = per.setdefault(ch["index"], {})
      parts = ch.get("delta") or {"text": ch.get("text", "")}
      for k, v in parts.items():
        m[k] = m.get(k, "" if isinstance(v, str) else []) + v
      lp = ch.get("logprobs")
      if lp:
        for k, v in lp.items():
          if isinstance(v, list):
            m[f"lp.{k}"] = m.get(f"lp.{k}", []) + v
      if ch.get("finish_reason"):
        m["finish_reason"] = ch["finish_reason"]
  return [sorted(per.items()), usage, done]


def http_runs(out: dict, weights) -> None:
  from starlette.testclient import TestClient
  from k3_jax.serve.server import build_app
  cfg, g, p, r = weights
  eng = Engine(cfg, g, p, r, tokenizer=ByteTokenizer(), max_batch=4, prefix_cache_bytes=1 << 22)
  app = build_app(eng, ByteTokenizer(), "k3-test")
  bodies = [
      ("/v1/completions", {"prompt": "def f(x):\n  ", "max_tokens": 9, "temperature": 0}),
      ("/v1/completions", {"prompt": ["ab", "hello world"], "max_tokens": 5, "n": 2,
                           "seed": 4, "temperature": 1.0, "logprobs": 2}),
      ("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 4, "echo": True,
                           "logprobs": 1, "temperature": 0}),
      ("/v1/completions", {"prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 0}),
      ("/v1/completions", {"prompt": "zz", "max_tokens": 6, "best_of": 3, "n": 2, "seed": 1,
                           "temperature": 1.0}),
      ("/v1/completions", {"prompt": "stream me", "max_tokens": 6, "stream": True,
                           "logprobs": 2, "temperature": 0, "echo": True,
                           "stream_options": {"include_usage": True}}),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 7, "temperature": 0, "logprobs": True,
                                "top_logprobs": 2}),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "yo"}],
                                "max_tokens": 5, "n": 3, "seed": 2, "temperature": 1.0,
                                "stream": True, "stream_options": {"include_usage": True}}),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "json"}],
                                "max_tokens": 12, "temperature": 0,
                                "response_format": {"type": "json_object"}}),
      ("/v1/completions", {"prompt": "x", "max_tokens": 3, "temperature": 5}),
      ("/v1/chat/completions", {"messages": "nope"}),
  ]
  with TestClient(app) as http:
    for i, (path, body) in enumerate(bodies):
      res = http.post(path, json={"model": "k3-test", **body})
      if body.get("stream"):     # chunk boundaries follow thread timing: merged per choice
        got = _merged([json.loads(l[6:]) for l in res.text.splitlines()
                       if l.startswith("data: {")], res.text.rstrip().endswith("[DONE]"))
      else:
        got = _blank(res.json())
      out[f"http/{i}"] = np.frombuffer(json.dumps([res.status_code, got]).encode(), np.uint8)
    app.state.loop.stop()


def _timeless(key: str, arr) -> str:
  """An HTTP answer without what the engine thread's timing decides: how many prompt tokens
  a choice found cached (a sample forks off the first one's prefill only if that prefill
  is still running when it arrives) and a stream's per-chunk text offsets."""
  def drop(o):
    if isinstance(o, dict):
      return {k: drop(v) for k, v in o.items()
              if k not in ("prompt_tokens_details", "lp.text_offset")}
    return [drop(v) for v in o] if isinstance(o, list) else o
  return json.dumps(drop(json.loads(bytes(arr).decode())))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--record")
  ap.add_argument("--check")
  args = ap.parse_args(argv)
  cfg = _cfg()
  weights = (cfg, *train.split_model(create_model(cfg, seed=3)))
  out: dict = {}
  engine_runs(out, weights)
  http_runs(out, weights)
  if args.record:
    np.savez(args.record, **out)
    print(f"recorded {len(out)} arrays to {args.record}")
  if args.check:
    ref = np.load(args.check)
    bad = sorted(set(ref.files) ^ set(out))
    bad += [k for k in ref.files if k in out and not (
        _timeless(k, ref[k]) == _timeless(k, out[k]) if k.startswith("http/") else
        ref[k].shape == out[k].shape and np.array_equal(ref[k], out[k]))]
    for k in bad:
      print(f"DIFFERS: {k}")
      if k.endswith("meta") or k.startswith("http/"):
        print("  was:", bytes(ref[k]).decode() if k in ref.files else None)
        print("  now:", bytes(out[k]).decode() if k in out else None)
    print(f"{len(ref.files) - len(bad)} of {len(ref.files)} arrays bitwise equal")
    return 1 if bad else 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
