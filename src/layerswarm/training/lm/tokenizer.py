"""Training a decoder's tokenizer on the user's corpus: byte-level BPE (Hugging Face `tokenizers`).

Byte level, so any text encodes (no unknown token) and decodes back exactly. Digits are split one per
token before BPE sees them (as Llama 3 and GPT-4 do): numbers then tokenize the same wherever they
appear, which arithmetic needs, and no merge learnt from prose can swallow a task's characters.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from layerswarm.models.lm.tokenizer import SPECIALS

MIN_VOCAB = 256 + len(SPECIALS)  # every byte, and the special tokens


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"a byte-level vocabulary needs at least {MIN_VOCAB} tokens, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
