"""Input speed: tokens/s that the prepared-dataset loaders deliver, against the on-the-fly
text path and against what the k3_small train step consumes.

    python -m benchmarks.loader [--batches=300] [--batch_size=8] [--seq_len=256]
                                [--tokenizer=byte|synthetic|FILE] [--step_tokens_per_s=440]
                                [--out=DIR]

The corpus is the default one (the standard library's .py files, train split, ~11 MB).
It is written to a .jsonl once, prepared into ArrayRecord and into Parquet shards
(`prepare`, timed), and each loader is read for --batches batches of batch_size x seq_len
tokens (the k3_small default job's 8 x 256) after its first batch (timed apart: the
window-shuffle buffer's fill). Loaders:

  text        pipeline.make_dataset over the documents (tokenized as it goes), what
              `train --dataset=stdlib` / a .jsonl path uses
  arrayrecord prepared.PreparedIterator over the ArrayRecord shards (`train --dataset=DIR`)
  parquet     the same over Parquet shards

The train step's rate is not measured here: --step_tokens_per_s defaults to the k3_small
default job's ~400-440 tokens/s per step on this project's 2-core CPU machine, from
docs/results.md ("The default job with the counter-based init"). Writes loader.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from k3_jax.data import pipeline, prepare, prepared, sources, tokenizers  # noqa: E402


def synthetic_bpe(docs, path: str, vocab: int = 32768) -> str:
  """A tiktoken BPE file fitted to `docs`: the 256 bytes, then every prefix (of 2+ bytes) of
  the most frequent pre-tokenizer pieces, shorter first, up to `vocab` tokens. No real
  tokenizer ships with this project; this one does the work of one (the Kimi pre-tokenizer
  regex, then BPE merges over a ~32k vocabulary)."""
  import base64
  import collections

  import regex
  pat = regex.compile(tokenizers.KIMI_STYLE_PATTERN)
  counts = collections.Counter(p for d in docs[::4] for p in pat.findall(d))
  toks, seen = [bytes([i]) for i in range(256)], set()
  for piece, _ in counts.most_common():
    b = piece.encode("utf-8")
    for n in range(2, len(b) + 1):
      if b[:n] not in seen:
        seen.add(b[:n])
        toks.append(b[:n])
    if len(toks) >= vocab:
      break
  toks = toks[:256] + sorted(toks[256:vocab], key=len)
  with open(path, "w") as f:
    f.writelines(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(toks))
  return path


def _rate(it, batches: int, tokens_per_batch: int) -> dict:
  t0 = time.perf_counter()
  next(it)
  first = time.perf_counter() - t0
  real = 0.0
  t0 = time.perf_counter()
  for _ in range(batches):
    real += float(next(it)["loss_mask"].sum())
  dt = time.perf_counter() - t0
  return {"first_batch_s": round(first, 3), "seconds": round(dt, 3),
          "tokens_per_s": round(batches * tokens_per_batch / dt, 1),
          "target_tokens_per_s": round(real / dt, 1)}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batches", type=int, default=300)
  ap.add_argument("--batch_size", type=int, default=8)
  ap.add_argument("--seq_len", type=int, default=256)
  ap.add_argument("--tokenizer", default="byte", help="byte | a tiktoken file | synthetic "
                  "(a ~32k BPE fitted to the corpus, see synthetic_bpe)")
  ap.add_argument("--num_shards", type=int, default=8)
  ap.add_argument("--step_tokens_per_s", type=float, default=440.0,
                  help="the k3_small train step's tokens/s (docs/results.md)")
  ap.add_argument("--out", default="runs/bench_loader")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  docs = sources.stdlib_documents("train")
  if args.tokenizer == "synthetic":
    args.tokenizer = synthetic_bpe(docs, os.path.join(args.out, "synthetic_bpe.tiktoken"))
  tok = tokenizers.get_tokenizer(args.tokenizer)
  per_batch = args.batch_size * args.seq_len
  results: dict = {"batch_size": args.batch_size, "seq_len": args.seq_len,
                   "tokenizer": args.tokenizer, "documents": len(docs),
                   "corpus_bytes": sum(len(d.encode()) for d in docs),
                   "step_tokens_per_s": args.step_tokens_per_s, "loaders": {}}
  with tempfile.TemporaryDirectory() as tmp:
    corpus = os.path.join(tmp, "stdlib.jsonl")
    with open(corpus, "w") as f:
      for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
    it = pipeline.make_dataset(docs, tok, args.seq_len, args.batch_size, seed=0)
    results["loaders"]["text"] = _rate(it, args.batches, per_batch)
    for fmt in ("arrayrecord", "parquet"):
      d = os.path.join(tmp, fmt)
      t0 = time.perf_counter()
      m = prepare.prepare(corpus, d, args.tokenizer, fmt, num_shards=args.num_shards,
                          progress=False)
      prep = time.perf_counter() - t0
      it = prepared.PreparedIterator(d, args.seq_len, args.batch_size, seed=0)
      r = _rate(it, args.batches, per_batch)
      r.update(prepare_s=round(prep, 2), prepare_tokens_per_s=round(m["tokens"] / prep, 1),
               shard_bytes=sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)))
      results["loaders"][fmt] = r
  for r in results["loaders"].values():
    r["x_train_step"] = round(r["tokens_per_s"] / args.step_tokens_per_s, 1)
  text = results["loaders"]["text"]["tokens_per_s"]
  print(f"batch {args.batch_size} x {args.seq_len}, tokenizer {tok!r}, "
        f"{len(docs)} stdlib documents; k3_small train step ~{args.step_tokens_per_s:,.0f} "
        f"tokens/s (docs/results.md)")
  print(f"{'loader':<12} {'tokens/s':>12} {'x step':>8} {'x text':>8} {'first batch':>12}")
  for name, r in results["loaders"].items():
    print(f"{name:<12} {r['tokens_per_s']:>12,.0f} {r['x_train_step']:>7.1f}x "
          f"{r['tokens_per_s'] / text:>7.2f}x {r['first_batch_s']:>11.2f}s")
  with open(os.path.join(args.out, "loader.json"), "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
