"""The language-model data: generated answers are right, test prompts never trained on, digits one token
each, loss masks on the right tokens, and bad specs refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerswarm.models.lm.config import LMConfig
from layerswarm.training.lm.data import encode, load_corpus, parse_spec
from layerswarm.training.lm.tasks import make_examples
from layerswarm.training.lm.tokenizer import train_bpe


def test_generated_answers_are_right_and_test_prompts_unseen() -> None:
    train, test = make_examples(2000, 200, seed=3)
    for e in train + test:
        body = e.prompt[:-1]
        if e.task == "add":
            a, b = body.split("+")
            assert int(e.answer) == int(a) + int(b)
        elif e.task == "rev":
            assert e.answer == body.removeprefix("rev:")[::-1]
        elif e.task == "sort":
            assert e.answer == "".join(sorted(body.removeprefix("sort:")))
        else:
            pairs, key = body.split("?")
            assert dict(zip(pairs[::2], pairs[1::2], strict=True))[key] == e.answer
    assert not {e.prompt for e in test} & {e.prompt for e in train}
    assert {e.task for e in test} == {"add", "rev", "sort", "kv"}
    assert make_examples(50, 10, seed=3) != make_examples(50, 10, seed=4)


def test_digits_are_one_token_each_whatever_bpe_learns() -> None:
    tok = train_bpe(["1234567890 " * 50, "rev:112233=332211"] * 20, 300)
    assert tok.encode("rev:90817=71809").tokens[-5:] == list("71809")
    assert tok.decode(tok.encode("héllo, wörld 42").ids) == "héllo, wörld 42"  # byte level: nothing is lost


def test_rows_put_the_loss_on_answers_and_on_every_text_token() -> None:
    corpus = load_corpus("lm:tasks:40:8+pydoc", seed=0)
    assert corpus.test_texts and corpus.train_texts and not set(corpus.test_texts) & set(corpus.train_texts)
    tok = train_bpe(corpus.tokenizer_texts(), 400)
    cfg = LMConfig(vocab_size=400, max_seq_len=64)
    data = encode(corpus, tok, cfg, text_len=32)
    tasks, text = data.train
    row = 0
    example = corpus.train_examples[row]
    answer_ids = tok.encode(example.answer, add_special_tokens=False).ids
    assert tasks.ids[row][tasks.loss[row]].tolist() == [*answer_ids, cfg.eos_id]
    assert tasks.ids[row, 0] == cfg.bos_id and not tasks.loss[:, 0].any()
    assert text.ids.shape[1] == 32 and bool(text.loss[:-1, 1:].all())  # every token after <s>, last row padded


def test_bad_specs_are_refused_by_name(tmp_path: Path) -> None:
    for spec, reason in (
        ("lm:", "not a language-model data spec"),
        ("lm:tasks:x", "whole numbers"),
        ("lm:nothing", "unknown source"),
        ("lm:txt:/no/such/file", "not a file"),
        ("lm:tasks+tasks", "twice"),
    ):
        with pytest.raises(ValueError, match=reason):
            parse_spec(spec)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"body": "two"}) + "\n")
    with pytest.raises(ValueError, match="line 2 needs an object with a string field text"):
        load_corpus(f"lm:jsonl:{bad}")
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(f"paragraph {i} of some text" for i in range(30)))
    assert len(load_corpus(f"lm:txt:{text}").test_texts) == 3
