"""Generation's pure parts: what text a stream may show (stop sequences, held-back prefixes and incomplete
characters), the chat template, a hop's input log, and who may serve a position."""

from __future__ import annotations

import pytest
import torch

from layerswarm.coordinator.generation.routes import choose, may_skip
from layerswarm.coordinator.generation.rows import RowLog
from layerswarm.coordinator.generation.stops import TextStream
from layerswarm.coordinator.http.chat import Message, render
from layerswarm.coordinator.membership.records import NodeIdentity, NodeRecord, NodeState, StreamLimits


def stream_of(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[str], bool, TextStream]:
    """Push one token per piece (the decode joins the pieces); the deltas shown and whether a stop hit."""
    text = TextStream(lambda ids: "".join(pieces[i] for i in ids), stops)
    shown, stopped = [], False
    for i in range(len(pieces)):
        delta, stopped = text.push(i)
        shown.append(delta)
        if stopped:
            break
    return shown, stopped, text


def test_a_stop_sequence_split_over_tokens_is_never_shown() -> None:
    shown, stopped, text = stream_of(["hello", " wo", "rld\nus", "er: more"], ("\nuser:",))
    assert stopped and "".join(shown) == "hello world" and text.visible == "hello world"
    assert shown == ["hello", " wo", "rld", ""]  # "\nus" held back until it became the stop


def test_a_prefix_that_does_not_become_a_stop_is_shown_once_it_cannot() -> None:
    shown, stopped, text = stream_of(["a\nu", "x", "y"], ("\nuser:",))
    assert not stopped and shown == ["a", "\nux", "y"]
    assert text.flush() == "" and text.visible == "a\nuxy"


def test_incomplete_characters_wait_for_the_rest() -> None:
    shown, _, _ = stream_of(["caf", "\ufffd", "é"], ())
    assert shown == ["caf", "", "\ufffdé"]  # the decode of the pieces keeps the replacement char here
    shown2, _, text2 = stream_of(["ok", "\ufffd"], ())
    assert shown2 == ["ok", ""] and text2.flush() == "\ufffd"  # at the end, shown as it is


def test_chat_template() -> None:
    messages = [
        Message(role="developer", content="be brief"),
        Message(role="user", content=[{"type": "text", "text": "47+8="}]),
    ]  # type: ignore[list-item]
    assert render(messages) == "system: be brief\nuser: 47+8=\nassistant:"


def test_a_row_log_rewrites_from_a_row_and_keeps_what_was_sent() -> None:
    log = RowLog(4, torch.float16)
    x = torch.randn(1, 20, 4)
    log.put(0, x)
    assert log.length == 20 and torch.equal(log.rows(), x.half().float())
    y = torch.randn(1, 3, 4)
    log.put(5, y)
    assert log.length == 8 and torch.equal(log.rows(5), y.half().float())
    assert torch.equal(log.rows(0, 5), x[:, :5].half().float())
    rows = log.rows()
    log.put(0, torch.zeros(1, 8, 4))
    assert not torch.equal(rows, log.rows())  # rows() is a copy: later puts do not change it
    with pytest.raises(ValueError):
        log.put(9, y)


def record(
    address: str, model: str, streams: int = 4, state: NodeState = NodeState.HEALTHY, ms: float = 1.0
) -> NodeRecord:
    ident = NodeIdentity("fam", model, 2, "layershuffle", "sha", "boot", 1, 4, 96, 32, True,
                         stream_limits=StreamLimits(streams, 96, 1 << 20, 60.0))  # fmt: skip
    return NodeRecord(address, "static", state=state, identity=ident, ewma_ms=ms)


def test_who_may_serve_a_position() -> None:
    own, sibling, busy, down = (
        record("a:1", "own", ms=5.0),
        record("b:1", "other"),
        record("c:1", "own"),
        record("d:1", "own", state=NodeState.EJECTED),
    )
    nodes = [sibling, busy, own, down]
    assert choose(nodes, "own", robust=True, open_streams={"c:1": 3}) is own  # our model, least loaded
    assert choose(nodes, "own", robust=True, open_streams={}) is busy  # equally loaded: the faster one
    assert choose([sibling, down], "own", robust=True, open_streams={}) is sibling  # robust: a sibling stands in
    assert choose([sibling, down], "own", robust=False, open_streams={}) is None  # a baseline: never
    assert choose(nodes, "own", robust=True, open_streams={}, exclude={"a:1", "c:1"}) is sibling
    assert may_skip(4, 3) and not may_skip(3, 3)
