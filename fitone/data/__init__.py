"""Datasets -> padded (or packed) batches, for seq2seq and causal LMs, plus the worst-case batch the probe uses.

Its functions take DataSettings (`cfg.data_settings()`), never the whole TrainConfig. One module a job:
sources.py  --data / --eval-data opened as memory-mapped rows (files, globs, save_to_disk, hub ids, `sample`)
chat.py     chat `messages` rows: checked, rendered by the chat template, the loss on the assistant turns
tokens.py   rows -> tokenised examples (the tokenizer's own BOS/EOS), truncated, packed with --pack
synthetic.py  `--data synthetic`: random tokens at the maximum lengths
batches.py  examples -> batches in a seeded order per epoch (resume sees the same), the worst-case batch
examples.py what an example and a dataset are
This module names what the rest of fitone uses; tests of one job import from its module.
"""

from fitone.data.batches import (batches, collate, loss_tokens, require_one_batch, resume_position, steps_per_epoch,
                                 worst_case_batch)
from fitone.data.chat import chat_tokenizer
from fitone.data.examples import IGNORE_INDEX, Dataset, Example
from fitone.data.sources import SAMPLE_EVAL, SAMPLE_TRAIN, ChatFields, Rows, data_file, open_data
from fitone.data.tokens import load_dataset

__all__ = ["IGNORE_INDEX", "SAMPLE_EVAL", "SAMPLE_TRAIN", "ChatFields", "Dataset", "Example", "Rows", "batches",
           "chat_tokenizer", "collate", "data_file", "load_dataset", "loss_tokens", "open_data", "require_one_batch",
           "resume_position", "steps_per_epoch", "worst_case_batch"]
