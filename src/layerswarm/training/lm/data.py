"""A language model's data, all local: generated tasks and real text, named by one spec.

    lm:SOURCE[+SOURCE...]
      tasks[:N_TRAIN[:N_TEST]]   generated prompts with exactly checkable answers (tasks.py); the loss is on
                                 the answer tokens, and exact match is measured on the test prompts
      pydoc                      real English text shipped with Python itself: the language reference's
                                 topics (pydoc_data.topics, about 0.46 MB), split into paragraphs
      txt:PATH                   a plain-text file, split into paragraphs at blank lines
      jsonl:PATH                 one JSON object per line with a "text" field

Text is held out by paragraph (TEST_SHARE, seeded); tasks by prompt. A share of the training part is
kept for validation (the trainer keeps the weights with the lowest validation loss). Encoded, each source
is a TokenRows: (N, T) ids and a mask of the tokens that count in the loss.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from pydoc_data.topics import topics  # the language reference, part of every CPython install

import torch
from tokenizers import Tokenizer
from torch import Tensor

from layerswarm.models.lm.config import LMConfig

from .tasks import Example, make_examples

PREFIX = "lm:"
SPEC_HELP = "lm:SOURCE[+SOURCE...], sources tasks[:N_TRAIN[:N_TEST]], pydoc, txt:PATH, jsonl:PATH"
DEFAULT_TASKS = (50_000, 1_000)
TEST_SHARE = 0.1  # of a text corpus's paragraphs
VAL_SHARE = 0.05  # of the training part
MAX_VAL = 1_000  # task examples or text paragraphs kept for validation, at most
MAX_FILE_BYTES = 200 << 20


def is_lm_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


@dataclass(frozen=True)
class Source:
    kind: str  # tasks | pydoc | txt | jsonl
    arg: str = ""


def parse_spec(spec: str) -> list[Source]:
    """The sources an lm: spec names, checked (files exist, counts parse); ValueError says what is wrong."""
    if not is_lm_spec(spec) or not spec[len(PREFIX) :]:
        raise ValueError(f"{spec!r} is not a language-model data spec: {SPEC_HELP}")
    sources = []
    for part in spec[len(PREFIX) :].split("+"):
        kind, _, arg = part.partition(":")
        if kind == "tasks":
            _task_counts(arg)
        elif kind == "pydoc":
            if arg:
                raise ValueError("pydoc takes no argument")
        elif kind in ("txt", "jsonl"):
            if not Path(arg).is_file():
                raise ValueError(f"{kind}:{arg}: not a file")
        else:
            raise ValueError(f"unknown source {part!r} in {spec!r}: {SPEC_HELP}")
        sources.append(Source(kind, arg))
    if sum(s.kind == "tasks" for s in sources) > 1:
        raise ValueError(f"{spec!r} names tasks twice")
    return sources


def _task_counts(arg: str) -> tuple[int, int]:
    parts = [p for p in arg.split(":") if p] if arg else []
    try:
        counts = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"tasks:{arg}: counts must be whole numbers (tasks:N_TRAIN:N_TEST)") from None
    if len(counts) > 2 or any(c < 1 for c in counts):
        raise ValueError(f"tasks:{arg}: use tasks[:N_TRAIN[:N_TEST]] with counts of at least 1")
    train = counts[0] if counts else DEFAULT_TASKS[0]
    test = counts[1] if len(counts) > 1 else DEFAULT_TASKS[1]
    return train, test


@dataclass
class LMCorpus:
    """Raw texts and task examples, split: what a tokenizer is trained on and data is encoded from."""

    spec: str
    train_texts: list[str] = field(default_factory=list)
    val_texts: list[str] = field(default_factory=list)
    test_texts: list[str] = field(default_factory=list)
    train_examples: list[Example] = field(default_factory=list)
    val_examples: list[Example] = field(default_factory=list)
    test_examples: list[Example] = field(default_factory=list)

    def tokenizer_texts(self) -> Iterator[str]:
        yield from self.train_texts
        yield from (e.text for e in self.train_examples)


def load_corpus(spec: str, seed: int = 0) -> LMCorpus:
    corpus = LMCorpus(spec)
    rng = random.Random(seed)
    for source in parse_spec(spec):
        if source.kind == "tasks":
            n_train, n_test = _task_counts(source.arg)
            train, corpus.test_examples = make_examples(n_train, n_test, seed)
            n_val = min(MAX_VAL, int(len(train) * VAL_SHARE))
            corpus.val_examples, corpus.train_examples = train[:n_val], train[n_val:]
            continue
        paragraphs = _paragraphs(source)
        rng.shuffle(paragraphs)
        n_test = max(1, int(len(paragraphs) * TEST_SHARE))
        n_val = max(1, min(MAX_VAL, int(len(paragraphs) * VAL_SHARE)))
        corpus.test_texts += paragraphs[:n_test]
        corpus.val_texts += paragraphs[n_test : n_test + n_val]
        corpus.train_texts += paragraphs[n_test + n_val :]
    if corpus.test_texts and not corpus.train_texts:
        raise ValueError(f"{spec}: too little text to hold some out and train on the rest")
    return corpus


def _paragraphs(source: Source) -> list[str]:
    if source.kind == "pydoc":
        texts = [topics[name] for name in sorted(topics)]
    elif source.kind == "txt":
        texts = [_read(source)]
    else:
        texts = _jsonl_texts(source)
    # Each paragraph once (the reference repeats short ones, "Notes:"): a held-out one is never trained on.
    paragraphs = list(dict.fromkeys(p.strip() for text in texts for p in text.split("\n\n") if p.strip()))
    if len(paragraphs) < 3:
        raise ValueError(f"{source.kind}:{source.arg}: needs at least 3 paragraphs (blank-line separated)")
    return paragraphs


def _read(source: Source) -> str:
    path = Path(source.arg)
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"{source.kind}:{path}: larger than {MAX_FILE_BYTES >> 20} MB")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{source.kind}:{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _jsonl_texts(source: Source) -> list[str]:
    texts = []
    for number, line in enumerate(_read(source).splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"jsonl:{source.arg}: line {number} is not JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ValueError(f"jsonl:{source.arg}: line {number} needs an object with a string field text")
        texts.append(obj["text"])
    return texts


# --- encoded ------------------------------------------------------------------------------------------


@dataclass
class TokenRows:
    """One source's rows: ids (N, T), pad-filled; loss (N, T) True where the token is a target (predicted
    from the tokens before it). Row t = 0 is <s>, never a target."""

    source: str  # "tasks" or "text"
    ids: Tensor
    loss: Tensor

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def subset(self, index: Tensor) -> TokenRows:
        return TokenRows(self.source, self.ids[index], self.loss[index])

    @property
    def targets(self) -> int:
        return int(self.loss.sum())


@dataclass
class LMData:
    spec: str
    train: list[TokenRows]
    val: list[TokenRows]
    test: list[TokenRows]
    val_examples: list[Example]
    test_examples: list[Example]

    def describe(self) -> dict[str, object]:
        return {
            "spec": self.spec,
            "sources": [r.source for r in self.train],
            "train_rows": {r.source: len(r) for r in self.train},
            "train_target_tokens": {r.source: r.targets for r in self.train},
            "test_rows": {r.source: len(r) for r in self.test},
            "test_examples": len(self.test_examples),
        }


def encode(corpus: LMCorpus, tok: Tokenizer, cfg: LMConfig, text_len: int) -> LMData:
    """Every split as TokenRows (tasks first, then text), text cut into rows of text_len tokens."""

    def rows(texts: list[str], examples: list[Example]) -> list[TokenRows]:
        out = []
        if examples:
            out.append(task_rows(examples, tok, cfg))
        if texts:
            out.append(text_rows(texts, tok, cfg, text_len))
        return out

    return LMData(
        corpus.spec,
        train=rows(corpus.train_texts, corpus.train_examples),
        val=rows(corpus.val_texts, corpus.val_examples),
        test=rows(corpus.test_texts, corpus.test_examples),
        val_examples=corpus.val_examples,
        test_examples=corpus.test_examples,
    )


def prompt_ids(tok: Tokenizer, cfg: LMConfig, example: Example) -> list[int]:
    return [cfg.bos_id, *tok.encode(example.prompt, add_special_tokens=False).ids]


def task_rows(examples: Sequence[Example], tok: Tokenizer, cfg: LMConfig) -> TokenRows:
    """<s> prompt answer </s>, the answer and </s> the targets."""
    seqs, answer_from = [], []
    for example in examples:
        prompt = prompt_ids(tok, cfg, example)
        answer = tok.encode(example.answer, add_special_tokens=False).ids
        seqs.append([*prompt, *answer, cfg.eos_id])
        answer_from.append(len(prompt))
    width = max(len(s) for s in seqs)
    if width > cfg.max_seq_len:
        raise ValueError(f"a task example has {width} tokens; the context is {cfg.max_seq_len}")
    ids = torch.full((len(seqs), width), cfg.pad_id, dtype=torch.long)
    loss = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, (seq, start) in enumerate(zip(seqs, answer_from, strict=True)):
        ids[row, : len(seq)] = torch.tensor(seq)
        loss[row, start : len(seq)] = True
    return TokenRows("tasks", ids, loss)


def text_rows(texts: Sequence[str], tok: Tokenizer, cfg: LMConfig, text_len: int) -> TokenRows:
    """The paragraphs as one stream (</s> after each), cut into rows of <s> + text_len - 1 tokens."""
    if not 2 <= text_len <= cfg.max_seq_len:
        raise ValueError(f"text rows of {text_len} tokens do not fit a context of {cfg.max_seq_len}")
    stream: list[int] = []
    for encoding in tok.encode_batch(list(texts), add_special_tokens=False):
        stream += [*encoding.ids, cfg.eos_id]
    step = text_len - 1
    n = (len(stream) + step - 1) // step
    ids = torch.full((n, text_len), cfg.pad_id, dtype=torch.long)
    loss = torch.zeros((n, text_len), dtype=torch.bool)
    ids[:, 0] = cfg.bos_id
    for row in range(n):
        piece = stream[row * step : (row + 1) * step]
        ids[row, 1 : 1 + len(piece)] = torch.tensor(piece)
        loss[row, 1 : 1 + len(piece)] = True
    return TokenRows("text", ids, loss)
