"""Text data, all local: a seeded generated task, and CSV / JSONL files of users' own labelled texts.

    words[:N_TRAIN[:N_TEST]]   generated: the label is the ORDERED pair of the two key words a sentence
                               holds among filler words (12 classes). It needs both words found and their
                               order compared: a composition of steps, so block order matters for a
                               conventionally trained encoder (the text counterpart of `shapes`).
    csv:PATH | jsonl:PATH      a `text` and a `label` column / key per row; 20 % held out (seeded)

A corpus is raw texts and labels; `encode_corpus` turns it into a Dataset of token ids with a model's
tokenizer (trained from the training texts, or the --init model's own; `load_text_data`: a model's own,
hash-checked).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from layerswarm.models.checkpoint import TOKENIZER, Manifest, read_manifest, verified_file
from layerswarm.models.text.tokenizer import encode_one, load_tokenizer, pad_batch

from ..data.datasets import DataRecord, Dataset, parse_shape_counts

TEXT_KINDS = ("words", "csv", "jsonl")
TEXT_SPECS = "words[:N_TRAIN[:N_TEST]], csv:PATH or jsonl:PATH (columns text, label)"
KEY_WORDS = ("red", "green", "blue", "gold")
FILLER_WORDS = (
    "the",
    "a",
    "an",
    "of",
    "to",
    "in",
    "on",
    "at",
    "by",
    "with",
    "from",
    "over",
    "under",
    "near",
    "far",
    "big",
    "small",
    "old",
    "new",
    "quick",
    "slow",
    "bright",
    "dark",
    "river",
    "hill",
    "house",
    "road",
    "tree",
    "stone",
    "cloud",
    "field",
    "bird",
    "wind",
    "song",
    "door",
    "light",
    "sea",
    "town",
    "wall",
    "day",
    "night",
)
ORDERED_PAIRS = tuple((a, b) for a in range(len(KEY_WORDS)) for b in range(len(KEY_WORDS)) if a != b)
TEST_FRACTION = 0.2
MAX_FILE_ROWS = 1_000_000


def is_text_spec(spec: str) -> bool:
    return spec.partition(":")[0] in TEXT_KINDS


@dataclass
class TextCorpus:
    name: str
    spec: str
    train_texts: list[str]
    train_y: torch.Tensor
    test_texts: list[str]
    test_y: torch.Tensor
    class_names: tuple[str, ...]


class TextDataset(Dataset):
    """A Dataset whose x are (N, T) int64 token ids ([PAD]-filled), so the image trainer runs it as is."""

    @property
    def image_shape(self) -> tuple[int, int, int]:
        raise TypeError("a text dataset has no image shape")

    def describe(self) -> DataRecord:
        assert isinstance(self.train_x, torch.Tensor)
        return {
            "spec": self.spec,
            "name": self.name,
            "kind": "text",
            "train": len(self.train_y),
            "test": len(self.test_y),
            "classes": list(self.class_names),
            "max_tokens": int(self.train_x.shape[1]),
        }


def load_corpus(spec: str, seed: int = 0) -> TextCorpus:
    kind, _, arg = spec.partition(":")
    if kind == "words":
        n_train, n_test = parse_shape_counts(arg)
        return make_words(n_train, n_test, seed, spec)
    if kind in ("csv", "jsonl"):
        path = _existing_file(kind, arg)
        texts, labels = _read_csv(path) if kind == "csv" else _read_jsonl(path)
        return _split(kind, spec, texts, labels, seed)
    raise ValueError(f"unknown text data spec {spec!r}: use {TEXT_SPECS}")


def check_text_spec(spec: str) -> str:
    kind, _, arg = spec.partition(":")
    if kind == "words":
        parse_shape_counts(arg)
    else:
        _existing_file(kind, arg)
    return spec


def encode_corpus(corpus: TextCorpus, tok: Tokenizer, max_tokens: int) -> TextDataset:
    """Token ids, truncated to `max_tokens` ([CLS] included) and padded to the longest kept sequence."""

    def ids(texts: list[str]) -> torch.Tensor:
        return pad_batch([encode_one(tok, t, max_tokens, truncate=True) for t in texts], max_tokens)

    return TextDataset(
        corpus.name,
        corpus.spec,
        ids(corpus.train_texts),
        corpus.train_y,
        ids(corpus.test_texts),
        corpus.test_y,
        corpus.class_names,
    )


def model_tokenizer(model_dir: str | Path, manifest: Manifest | None = None) -> Tokenizer:
    """A text model's tokenizer, after checking its hash against the manifest."""
    manifest = manifest or read_manifest(model_dir)
    if not manifest.config.is_text:
        raise ValueError(f"{model_dir} is an image model; text data needs a text model")
    return load_tokenizer(verified_file(model_dir, manifest, TOKENIZER))


def load_text_data(spec: str, model_dir: str | Path) -> TextDataset:
    """A text data spec encoded with a model's own tokenizer (what eval and serving clients use)."""
    manifest = read_manifest(model_dir)
    corpus = load_corpus(spec, seed=int(manifest.dataset.get("data_seed", 0)))
    return encode_corpus(corpus, model_tokenizer(model_dir, manifest), manifest.config.max_tokens)


# --- generated ------------------------------------------------------------------------------------


def make_words(n_train: int, n_test: int, seed: int = 0, spec: str = "words") -> TextCorpus:
    rng = np.random.default_rng(seed)
    n = n_train + n_test
    labels = rng.integers(0, len(ORDERED_PAIRS), size=n)
    texts = []
    for label in labels:
        first, second = ORDERED_PAIRS[int(label)]
        words = list(rng.choice(FILLER_WORDS, size=int(rng.integers(5, 15))))
        i, j = sorted(rng.choice(len(words) + 2, size=2, replace=False).tolist())
        words.insert(i, KEY_WORDS[first])
        words.insert(j, KEY_WORDS[second])
        texts.append(" ".join(words))
    names = tuple(f"{KEY_WORDS[a]}>{KEY_WORDS[b]}" for a, b in ORDERED_PAIRS)
    y = torch.from_numpy(labels.astype(np.int64))
    return TextCorpus("words", spec, texts[:n_train], y[:n_train], texts[n_train:], y[n_train:], names)


# --- users' files ---------------------------------------------------------------------------------


def _existing_file(kind: str, arg: str) -> Path:
    if kind not in ("csv", "jsonl"):
        raise ValueError(f"unknown text data spec {kind!r}: use {TEXT_SPECS}")
    if not arg:
        raise ValueError(f"{kind} needs a path: {kind}:PATH")
    path = Path(arg)
    if not path.is_file():
        raise ValueError(f"{kind}: {arg} is not a file")
    return path


def _read_csv(path: Path) -> tuple[list[str], list[str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = {"text", "label"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"csv:{path}: needs columns text and label; missing {sorted(missing)}")
        rows = [(row["text"], row["label"]) for _, row in zip(range(MAX_FILE_ROWS), reader, strict=False)]
    return _checked(f"csv:{path}", rows)


def _read_jsonl(path: Path) -> tuple[list[str], list[str]]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"jsonl:{path}: line {number} is not JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or "text" not in obj or "label" not in obj:
                raise ValueError(f"jsonl:{path}: line {number} needs an object with keys text and label")
            rows.append((obj["text"], obj["label"]))
            if len(rows) >= MAX_FILE_ROWS:
                break
    return _checked(f"jsonl:{path}", rows)


def _checked(where: str, rows: list[tuple[object, object]]) -> tuple[list[str], list[str]]:
    for number, (text, label) in enumerate(rows, 1):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: row {number} has an empty or non-string text")
        if label is None or str(label) == "":
            raise ValueError(f"{where}: row {number} has no label")
    if len(rows) < 5:
        raise ValueError(f"{where}: {len(rows)} row(s); needs at least 5 to train and hold some out")
    return [str(t) for t, _ in rows], [str(label) for _, label in rows]


def _split(kind: str, spec: str, texts: list[str], labels: list[str], seed: int) -> TextCorpus:
    names = tuple(sorted(set(labels)))
    if len(names) < 2:
        raise ValueError(f"{spec}: needs at least 2 distinct labels, found {list(names)}")
    y = torch.tensor([names.index(label) for label in labels], dtype=torch.long)
    perm = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
    n_test = max(1, int(len(texts) * TEST_FRACTION))
    test, train = perm[:n_test], perm[n_test:]
    return TextCorpus(kind, spec, [texts[i] for i in train], y[train], [texts[i] for i in test], y[test], names)
