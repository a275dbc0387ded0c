"""Data: tokenizers, document sources, packed grain pipelines, synthetic MQAR, and the
training job's data assembled from a TrainConfig (datasets.train_data).

Names are re-exported lazily, so `from k3_jax.data import ByteTokenizer` (e.g.
in the server) does not pay for importing grain.
"""

import importlib

_EXPORTS = {
    "Tokenizer": "tokenizers", "ByteTokenizer": "tokenizers",
    "TiktokenTokenizer": "tokenizers", "StreamDecoder": "tokenizers",
    "get_tokenizer": "tokenizers",
    "stdlib_documents": "sources", "stdlib_named_documents": "sources",
    "text_documents": "sources",
    "BATCH_KEYS": "pipeline", "DataIterator": "pipeline",
    "make_dataset": "pipeline", "eval_batches": "pipeline",
    "mqar_batch": "mqar", "mqar_dataset": "mqar",
    "train_data": "datasets",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
