"""The training job's data, assembled from a TrainConfig: one call gives the train iterator
and the fixed eval batches of this process (its share of the global batch)."""

from __future__ import annotations

from typing import Callable

from k3_jax.config import ModelConfig, TrainConfig, UserError
from k3_jax.data import chat_sft, mqar, pipeline, prepared, shapes, sources, tokenizers

MQAR_KV_PAIRS = 8
EVAL_SEED_OFFSET = 10_000          # MQAR eval draws from a seed the train stream never uses


def train_data(cfg: ModelConfig, tc: TrainConfig, process_index: int = 0,
               process_count: int = 1, warn: Callable[[str], None] | None = None):
  """(train iterator, list of eval batches) for `tc.dataset` with `tc.tokenizer`.

  Each process gets batch_size / process_count rows per batch (its rows of the global
  batch). Text datasets: "stdlib" uses its own train / eval split; a path holds out every
  50th document (at least one) for eval when it has more than one document, else no eval.
  A .jsonl of chat conversations ({"messages": ...} lines) or a prepared directory of them
  is chat SFT data (k3_jax/data/chat_sft.py: the loss on assistant tokens only).
  The iterator is checkpointable (get_state / set_state). `warn` receives data-size warnings
  (a dataset shorter than one sequence, nothing held out for eval)."""
  if tc.batch_size % process_count:
    raise UserError(f"batch_size={tc.batch_size} must be divisible by the {process_count} "
                    f"processes")
  per_host = tc.batch_size // process_count
  if tc.dataset == "shapes":          # synthetic images + captions (needs cfg.vision)
    if cfg.vision is None:
      raise UserError(f"--dataset=shapes needs a model with a vision tower; {cfg.name} has none")
    tok = tokenizers.get_tokenizer(tc.tokenizer)
    return (shapes.ShapesIterator(per_host, tc.seq_len, cfg.vision, tok, seed=tc.seed,
                                  process_index=process_index),
            shapes.eval_batches(per_host, tc.seq_len, cfg.vision, tok, tc.eval_batches,
                                seed=tc.seed))
  if tc.dataset == "mqar":
    make = lambda seed: mqar.mqar_dataset(per_host, tc.seq_len, cfg.vocab_size,
                                          num_kv_pairs=MQAR_KV_PAIRS, seed=seed,
                                          process_index=process_index)
    eval_it = make(tc.seed + EVAL_SEED_OFFSET)
    return make(tc.seed), [next(eval_it) for _ in range(tc.eval_batches)]
  tok = tokenizers.get_tokenizer(tc.tokenizer)
  if tok.vocab_size > cfg.vocab_size:
    raise UserError(f"tokenizer vocabulary {tok.vocab_size} exceeds the model's "
                    f"vocab_size={cfg.vocab_size}")
  if prepared.is_prepared(tc.dataset):   # a `python main.py prepare` directory
    return prepared_data(tc, tok, process_index, process_count, warn)
  if chat_sft.is_chat_jsonl(tc.dataset):  # chat SFT: a conversation a line
    train, held_out = chat_sft.split_jsonl(chat_sft.read_jsonl(tc.dataset))
    return chat_sft.chat_data(tc.dataset, train, held_out, tok, tc.seq_len, per_host, tc.seed,
                              tc.eval_batches, process_index, process_count, warn)
  if tc.dataset == "stdlib":
    train_docs, eval_docs = sources.stdlib_documents("train"), sources.stdlib_documents("eval")
  else:
    docs = sources.text_documents(tc.dataset)
    n_eval = max(1, len(docs) // 50) if len(docs) > 1 else 0
    train_docs, eval_docs = docs[n_eval:], docs[:n_eval]
  for w in sources.size_warnings(tc.dataset, train_docs, eval_docs, tok, tc.seq_len):
    (warn or print)(f"warning: {w}")
  train_iter = pipeline.make_dataset(train_docs, tok, tc.seq_len, per_host, seed=tc.seed,
                                     process_index=process_index, process_count=process_count)
  evals = (pipeline.eval_batches(eval_docs, tok, tc.seq_len, per_host, tc.eval_batches,
                                 process_index=process_index, process_count=process_count)
           if eval_docs else [])
  return train_iter, evals


def prepared_data(tc: TrainConfig, tok, process_index: int, process_count: int,
                  warn: Callable[[str], None] | None = None):
  """(train iterator, eval batches) of a prepared directory (k3_jax/data/prepared.py); it must
  have been tokenized by `tok`. On a multi-host job the iterator's state is gathered over
  the processes at every checkpoint. A directory of chat conversations (kind "messages",
  stored untokenized) is rendered by `tok` now (k3_jax/data/chat_sft.py), whichever
  tokenizer `prepare` was given."""
  manifest = prepared.load_manifest(tc.dataset)
  if manifest["kind"] == "messages":
    per_host = tc.batch_size // process_count
    return chat_sft.chat_data(
        tc.dataset, chat_sft.read_prepared(tc.dataset, manifest, "train"),
        chat_sft.read_prepared(tc.dataset, manifest, "eval"), tok, tc.seq_len, per_host,
        tc.seed, tc.eval_batches, process_index, process_count, warn)
  prepared.check_tokenizer(tc.dataset, manifest, tok, tc.tokenizer)
  train_iter = prepared.PreparedIterator(
      tc.dataset, tc.seq_len, tc.batch_size, seed=tc.seed, process_index=process_index,
      process_count=process_count, manifest=manifest,
      allgather=prepared.jax_allgather if process_count > 1 else None)
  evals = prepared.eval_batches(tc.dataset, manifest, tc.seq_len, tc.batch_size,
                                tc.eval_batches, process_index, process_count)
  return train_iter, evals
