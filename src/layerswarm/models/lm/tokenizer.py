"""A decoder's tokenizer: a Hugging Face `tokenizers` JSON file in the model directory, hashed in the
manifest like the weights (never pickled). Trained ones (training/lm/tokenizer.py) are byte-level BPE
with <pad>, <s>, </s> at ids 0, 1, 2; imported ones keep their own ids, which the config records.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from tokenizers import Tokenizer

from .config import LMConfig

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIALS = (PAD, BOS, EOS)  # ids 0, 1, 2 in a trained tokenizer
TOKENIZER_FILE = "tokenizer.json"


class PromptError(ValueError):
    """A prompt a model cannot take: empty, or longer than its context (the message says which)."""


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own opaque types for malformed files
        raise ValueError(f"{path}: not a tokenizer.json ({exc})") from exc


def check_tokenizer(tok: Tokenizer, cfg: LMConfig, where: str) -> None:
    """The tokenizer's ids fit the model's vocabulary and its special tokens are the config's."""
    size = tok.get_vocab_size()
    if size > cfg.vocab_size:
        raise ValueError(f"{where}: the tokenizer has {size} tokens, the model only {cfg.vocab_size}")
    for name, token_id in (("bos_id", cfg.bos_id), ("eos_id", cfg.eos_id)):
        if token_id >= 0 and tok.id_to_token(token_id) is None:
            raise ValueError(f"{where}: the config's {name} {token_id} is not a token of the tokenizer")


def encode_prompt(tok: Tokenizer, text: str, cfg: LMConfig, room: int = 1) -> list[int]:
    """<s> + the text's ids; PromptError when it leaves fewer than `room` tokens of the context."""
    ids = tok.encode(text, add_special_tokens=False).ids
    prompt = ([cfg.bos_id] if cfg.bos_id >= 0 else []) + ids
    if not prompt:
        raise PromptError("the prompt is empty")
    if len(prompt) + room > cfg.max_seq_len:
        raise PromptError(f"the prompt has {len(prompt)} tokens; the context is {cfg.max_seq_len}")
    return prompt


def decode(tok: Tokenizer, ids: Sequence[int]) -> str:
    return tok.decode(list(ids), skip_special_tokens=True)
