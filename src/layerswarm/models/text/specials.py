"""The text family's special tokens and their ids: what the tokenizer reserves first and what the text
stem, the node and the coordinator read (torch- and tokenizers-free).

Every sequence starts with [CLS] (the head reads it); [PAD] fills batches and is never attended to;
[MASK] is for the reconstruction depth estimate; [UNK] stands for a word the vocabulary lacks.
"""

from __future__ import annotations

PAD, UNK, CLS, MASK = "[PAD]", "[UNK]", "[CLS]", "[MASK]"
SPECIALS = (PAD, UNK, CLS, MASK)  # ids 0..3 in this order
PAD_ID, UNK_ID, CLS_ID, MASK_ID = range(4)
