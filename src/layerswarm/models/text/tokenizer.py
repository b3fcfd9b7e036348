"""The text family's tokenizer: a word-level HF `tokenizers` model trained from the training texts.

Saved as DIR/tokenizer.json (plain JSON, hashed in the manifest like the weights; never pickled). Word
level on purpose: the per-token depth estimates (training/text/depth.py) are per word, as in the source paper.
Every sequence starts with [CLS] (the head reads it); [PAD] fills batches and is never attended to.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from .specials import CLS, CLS_ID, MASK, MASK_ID, PAD, PAD_ID, SPECIALS, UNK, UNK_ID

# The special tokens are the tokenizer's too: importers of this module read them here.
__all__ = [
    "CLS",
    "CLS_ID",
    "MASK",
    "MASK_ID",
    "PAD",
    "PAD_ID",
    "SPECIALS",
    "TOKENIZER_FILE",
    "UNK",
    "UNK_ID",
    "TextInputError",
    "encode_batch",
    "encode_one",
    "load_tokenizer",
    "pad_batch",
    "save_tokenizer",
    "train_tokenizer",
]

TOKENIZER_FILE = "tokenizer.json"


class TextInputError(ValueError):
    """A text a model cannot take: empty, or longer than the family's maximum (message says which)."""


def train_tokenizer(texts: Sequence[str], vocab_size: int = 8000, min_frequency: int = 1) -> Tokenizer:
    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIALS)
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, model_dir: str | os.PathLike[str]) -> Path:
    path = Path(model_dir) / TOKENIZER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own opaque types for malformed files
        raise ValueError(f"{path}: not a tokenizer.json ({exc})") from exc
    if [tok.token_to_id(s) for s in SPECIALS] != [PAD_ID, UNK_ID, CLS_ID, MASK_ID]:
        raise ValueError(f"{path}: special tokens are not {SPECIALS} at ids 0..3")
    return tok


def encode_one(tok: Tokenizer, text: str, max_tokens: int, truncate: bool = False) -> list[int]:
    """[CLS] + word ids. Raises TextInputError for empty text, or too long unless `truncate`."""
    ids = tok.encode(text, add_special_tokens=False).ids
    if not ids:
        raise TextInputError("text is empty (no words after normalisation)")
    if len(ids) + 1 > max_tokens:
        if not truncate:
            raise TextInputError(f"text has {len(ids)} words; this family takes at most {max_tokens - 1}")
        ids = ids[: max_tokens - 1]
    return [CLS_ID, *ids]


def pad_batch(sequences: Sequence[Sequence[int]], length: int | None = None) -> torch.Tensor:
    """(B, T) int64 ids, [PAD]-filled to the longest sequence (or `length`)."""
    width = length or max(len(s) for s in sequences)
    out = torch.full((len(sequences), width), PAD_ID, dtype=torch.long)
    for i, seq in enumerate(sequences):
        out[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def encode_batch(
    tok: Tokenizer, texts: Sequence[str], max_tokens: int, truncate: bool = False, length: int | None = None
) -> torch.Tensor:
    return pad_batch([encode_one(tok, t, max_tokens, truncate) for t in texts], length)
