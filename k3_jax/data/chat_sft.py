"""Chat fine-tuning data: conversations -> packed rows with the loss on assistant tokens only.

    chats.jsonl (a conversation a line) or a prepared "messages" directory
      -> held out: every EVAL_EVERY-th conversation (the 2nd, 52nd, ...; prepare's rule)
      -> this process's share: conversations[process_index::process_count]
      -> rendered by the server's chat template (data/chat.render_conversation):
         ids + the template's assistant mask
      -> conversations of more than seq_len + 1 tokens dropped (counted, one warning)
      -> shuffled (reshuffled each epoch), repeated
      -> first-fit packed whole into rows of seq_len + 1 tokens (grain), never split
      -> inputs, targets, segment ids, loss mask (pipeline.py's batch format)
    eval: the held-out conversations packed in order into global batches (at most
    eval_batches), each process taking its rows, so all evaluate the same batches

A line is an object with `messages` (OpenAI chat messages; assistant turns may carry
`reasoning_content` and `tool_calls`, tool results are `tool` messages), optionally `tools`
(the OpenAI tools array, rendered as the template puts it before the conversation) and
`thinking` (default true: the template's thinking mode, as the server renders by default;
false renders no think channel). Thinking is preserved as K3 was trained: in thinking mode
every assistant turn keeps its think channel (its `reasoning_content`, or `reasoning`; an
empty channel when it has none), and the loss is on every assistant turn's think channel,
response and tool calls.

The loss mask: loss_mask[t] = 1 where targets[t] = ids[t + 1] is an assistant token of the
same conversation (the template's mask: everything the assistant writes after
`<|open|>message role="assistant"<|sep|>`, think channel, response, tool calls and the
closing `<|end_of_msg|>`). Segment ids keep packed conversations from attending to (or
carrying recurrent state into) each other, as for text.

A conversation longer than a row cannot be learnt whole (a cut one would teach answers
without their question), so it is dropped, and the number dropped is reported in one
warning; a dataset where all are too long is refused. A conversation with no assistant
turn, or one using tools / tool calls / reasoning with a tokenizer that lacks the K3
special tokens (which only the K3 template renders), is refused in one line naming it.
Every conversation of this process's share is rendered when the job starts (the template is
Python: about 6,600 conversations of 214 tokens, 1.4M tokens, a second on one core here).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

from k3_jax.config import UserError
from k3_jax.data import pipeline, records
from k3_jax.data.prepare import EVAL_EVERY

Batch = pipeline.Batch


@dataclasses.dataclass(frozen=True)
class Conversation:
  record: dict          # {"messages": [...], "tools"?: [...], "thinking"?: bool}
  where: str            # for errors: "chats.jsonl:12" / "DIR train conversation 3"


def is_chat_jsonl(path: str) -> bool:
  """A .jsonl file whose first non-empty line is an object with a `messages` list."""
  if not (isinstance(path, str) and path.endswith(".jsonl") and os.path.isfile(path)):
    return False
  with open(path, "rb") as f:
    for raw in f:
      if raw.strip():
        try:
          rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
          return False
        return isinstance(rec, dict) and isinstance(rec.get("messages"), list)
  return False


def _checked(rec, where: str) -> dict:
  if isinstance(rec, list):             # a bare messages list (a user's Parquet column)
    rec = {"messages": rec}
  if not isinstance(rec, dict) or not isinstance(rec.get("messages"), list):
    raise UserError(f"{where}: expected a JSON object with a 'messages' list (a chat dataset "
                    f"holds conversations only; text lines go in a dataset of their own)")
  if "thinking" in rec and not isinstance(rec["thinking"], bool):
    raise UserError(f"{where}: 'thinking' must be true or false")
  return rec


def read_jsonl(path: str) -> list[Conversation]:
  """The conversations of a chats.jsonl file, in file order."""
  out = []
  with open(path, "rb") as f:
    for line_no, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      where = f"{path}:{line_no}"
      try:
        rec = json.loads(raw)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: not a JSON line ({e})") from None
      out.append(Conversation(_checked(rec, where), where))
  if not out:
    raise UserError(f"--dataset={path} holds no conversations")
  return out


def split_jsonl(convs: list[Conversation]) -> tuple[list[Conversation], list[Conversation]]:
  """(train, eval): conversation i is held out when i % EVAL_EVERY == 1, as `prepare` does, so
  a file and its prepared directory give the same splits."""
  train = [c for i, c in enumerate(convs) if i % EVAL_EVERY != 1]
  return train, [c for i, c in enumerate(convs) if i % EVAL_EVERY == 1]


def read_prepared(path: str, manifest: dict, split: str) -> list[Conversation]:
  """A prepared messages directory's `split`, in the order prepare read it (record k of a
  split went to shard k % n: the shards interleaved give the input order back)."""
  if split not in manifest["splits"]:
    return []
  info = manifest["splits"][split]
  sources = [records.open_source(manifest["format"], [os.path.join(path, f)], "messages")
             for f in info["shards"]]
  n, total = len(sources), sum(info["documents"])
  out = []
  for k in range(total):
    where = f"{path} {split} conversation {k}"
    text = sources[k % n][k // n]
    try:
      rec = json.loads(text)
    except json.JSONDecodeError as e:
      raise UserError(f"{where}: not valid JSON ({e})") from None
    out.append(Conversation(_checked(rec, where), where))
  return out


_K3_ONLY = "tools, tool calls and reasoning"


def render(tokenizer, conv: Conversation) -> tuple[np.ndarray, np.ndarray]:
  """(int32 ids, bool assistant mask) of one conversation, by the server's template."""
  from k3_jax.data import chat
  rec = conv.record
  k3 = chat.template_for(tokenizer).name == "k3"
  if not k3 and (rec.get("tools") or any(
      isinstance(m, dict) and (m.get("tool_calls") or m.get("reasoning_content")
                               or m.get("reasoning"))
      for m in rec["messages"])):
    raise UserError(f"{conv.where}: this conversation has {_K3_ONLY}, which only the K3 chat "
                    f"template renders, and the tokenizer {tokenizer!r} has no K3 special "
                    f"tokens (<|open|>, <|close|>, <|sep|>, <|end_of_msg|>); pass a K3 "
                    f"tokenizer (--tokenizer=DIR)")
  try:
    ids, mask = chat.render_conversation(tokenizer, rec["messages"], rec.get("tools"),
                                         thinking=rec.get("thinking", True))
  except chat.ChatError as e:
    raise UserError(f"{conv.where}: {e}") from None
  if not any(mask):
    raise UserError(f"{conv.where}: a conversation with no assistant turn (nothing to learn; "
                    f"chat SFT trains on the assistant's tokens only)")
  return np.asarray(ids, np.int32), np.asarray(mask, bool)


@dataclasses.dataclass
class Rendered:
  examples: list[dict]          # {"tokens": int32 [T], "mask": int32 [T]}
  dropped: int = 0              # longer than seq_len + 1
  tokens: int = 0
  assistant_tokens: int = 0


def render_all(tokenizer, convs: Sequence[Conversation], seq_len: int) -> Rendered:
  out = Rendered([])
  for c in convs:
    ids, mask = render(tokenizer, c)
    if len(ids) > seq_len + 1:
      out.dropped += 1
      continue
    out.examples.append({"tokens": ids, "mask": mask.astype(np.int32)})
    out.tokens += len(ids)
    out.assistant_tokens += int(mask[1:].sum())
  return out


def _row_to_example(row: dict[str, np.ndarray]) -> Batch:
  """Packed row of S + 1 tokens and assistant mask -> one example of length S."""
  tokens, seg, mask = row["tokens"], row["tokens_segment_ids"], row["mask"]
  same = (seg[:-1] == seg[1:]) & (seg[:-1] != 0)
  learn = same & (mask[1:] != 0)
  return {"inputs": tokens[:-1].astype(np.int32),
          "targets": np.where(learn, tokens[1:], 0).astype(np.int32),
          "segment_ids": seg[:-1].astype(np.int32),
          "loss_mask": learn.astype(np.float32)}


def packed_examples(examples: Sequence[dict], seq_len: int, *, seed: int, shuffle: bool,
                    num_epochs: int | None, num_packing_bins: int) -> grain.IterDataset:
  """Rendered conversations -> unbatched packed examples (each conversation whole)."""
  ds = grain.MapDataset.source(list(examples))
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs).to_iter_dataset()
  rows = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct={"tokens": seq_len + 1, "mask": seq_len + 1},
      num_packing_bins=num_packing_bins, seed=seed, shuffle_bins=shuffle)
  return rows.map(_row_to_example)


def make_chat_dataset(examples: Sequence[dict], seq_len: int, batch_size: int, seed: int,
                      shuffle: bool = True, num_epochs: int | None = None,
                      num_packing_bins: int | None = None,
                      fingerprint: dict | None = None) -> pipeline.DataIterator:
  """A checkpointable iterator of packed chat batches (pipeline.DataIterator)."""
  if not examples:
    raise ValueError("no conversations to train on")
  bins = num_packing_bins or 4 * batch_size
  batches = packed_examples(examples, seq_len, seed=seed, shuffle=shuffle,
                            num_epochs=num_epochs, num_packing_bins=bins).batch(
      batch_size, drop_remainder=False).map(lambda b: pipeline._pad_batch(b, batch_size))  # pylint: disable=protected-access
  fp = {"kind": "chat", "conversations": len(examples),
        "tokens": int(sum(len(e["tokens"]) for e in examples)), "seq_len": seq_len,
        "batch_size": batch_size, "seed": seed, "shuffle": shuffle, "num_epochs": num_epochs,
        "num_packing_bins": bins, **(fingerprint or {})}
  return pipeline.DataIterator(batches, fp)


def chat_eval_batches(examples: Sequence[dict], seq_len: int, batch_size: int,
                      num_batches: int) -> list[Batch]:
  """Up to `num_batches` fixed batches of the held-out conversations, packed in order."""
  if not examples or num_batches < 1:
    return []
  it = make_chat_dataset(examples, seq_len, batch_size, seed=0, shuffle=False, num_epochs=1)
  out = []
  for b in it:
    out.append(b)
    if len(out) == num_batches:
      break
  return out


def chat_data(name: str, train: Sequence[Conversation], held_out: Sequence[Conversation],
              tokenizer, seq_len: int, per_host: int, seed: int, eval_batches: int,
              process_index: int = 0, process_count: int = 1,
              warn: Callable[[str], None] | None = None):
  """(train iterator, eval batches) of this process for conversations already split."""
  warn = warn or (lambda m: print(m))
  if len(train) < process_count:
    raise UserError(f"--dataset={name}: {len(train)} train conversations cannot be shared by "
                    f"{process_count} processes")
  r = render_all(tokenizer, train[process_index::process_count], seq_len)
  if not r.examples:
    raise UserError(f"--dataset={name}: every conversation ({r.dropped}) is longer than "
                    f"seq_len + 1 = {seq_len + 1} tokens; raise --seq_len")
  if r.dropped:
    warn(f"warning: --dataset={name}: dropped {r.dropped} of {r.dropped + len(r.examples)} "
         f"conversations longer than seq_len + 1 = {seq_len + 1} tokens (raise --seq_len to "
         f"keep them)")
  if not held_out:
    warn(f"warning: dataset {name!r} has too few conversations to hold one out for "
         f"evaluation (every {EVAL_EVERY}th is); eval_loss will not be reported")
  it = make_chat_dataset(r.examples, seq_len, per_host, seed=seed, fingerprint={
      "tokenizer": repr(tokenizer),
      "process_index": process_index, "process_count": process_count,
      "dropped": r.dropped})
  # eval: the global batches of every held-out conversation (a small set), sliced by
  # process, so every process evaluates the same number of batches
  e = render_all(tokenizer, held_out, seq_len)
  n = per_host * process_count
  evals = [{k: v[process_index * per_host:(process_index + 1) * per_host] for k, v in b.items()}
           for b in chat_eval_batches(e.examples, seq_len, n, eval_batches)]
  return it, evals


__all__ = ["Conversation", "is_chat_jsonl", "read_jsonl", "split_jsonl", "read_prepared",
           "render", "render_all", "make_chat_dataset", "chat_eval_batches", "chat_data",
           "packed_examples"]

