"""The OpenAI-compatible API through real processes, called with the official `openai` package: completions
and chat, streamed and not, equal the monolith's text (greedy, and sampled with a seed); usage counts;
/v1/models; and every bad request is a 4xx in OpenAI's error format naming the parameter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from layerswarm.coordinator.http.chat import CHAT_STOPS
from layerswarm.harness.procs import stop_all
from layerswarm.models.checkpoint import TOKENIZER, load_lm
from layerswarm.models.lm.tokenizer import decode, load_tokenizer

from ..generation_helpers import make_family, wait_ready
from ..swarm import coordinator_process, start_nodes

pytestmark = pytest.mark.slow
TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_family(tmp_path_factory.mktemp("lm-openai"), members=1)[0]


@pytest.fixture(scope="module")
def base(model_dir: Path) -> Iterator[str]:
    nodes = start_nodes([(model_dir, b) for b in range(4)])
    coord = coordinator_process(
        model_dir, nodes, "--health-interval", "0.2", "--wire-dtype", "fp32", "--max-new-tokens", "64"
    )
    try:
        url = f"http://127.0.0.1:{coord.ready['port']}"
        wait_ready(url)
        yield url
    finally:
        stop_all([coord, *nodes])


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def reference(model_dir: Path, text: str, stops: tuple[str, ...] = (), **sampling: Any) -> tuple[str, int]:
    """The monolith's continuation of <s> + text, as text cut at the first stop, and its token count."""
    model, manifest = load_lm(model_dir)
    tok = load_tokenizer(model_dir / TOKENIZER)
    ids = [manifest.config.bos_id, *tok.encode(text, add_special_tokens=False).ids]
    out = model.generate(ids, TOKENS, **sampling)
    full = decode(tok, out)
    cut = min((i for s in stops if (i := full.find(s)) >= 0), default=len(full))
    return full[:cut], len(ids)


def test_completions_streamed_and_not_equal_the_monolith(client: openai.OpenAI, model_dir: Path) -> None:
    assert [m.id for m in client.models.list()] == [model_dir.name]
    expected, prompt_tokens = reference(model_dir, "12+34=")
    whole = client.completions.create(model=model_dir.name, prompt="12+34=", max_tokens=TOKENS, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.usage is not None and whole.usage.prompt_tokens == prompt_tokens
    assert whole.usage.completion_tokens + prompt_tokens == whole.usage.total_tokens
    assert whole.choices[0].finish_reason in ("length", "stop")
    chunks = list(
        client.completions.create(
            model=model_dir.name,
            prompt="12+34=",
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    sampled, _ = reference(model_dir, "rev:123=", temperature=0.9, top_p=0.95, seed=11)
    again = client.completions.create(
        model=model_dir.name, prompt="rev:123=", max_tokens=TOKENS, temperature=0.9, top_p=0.95, seed=11
    )
    assert again.choices[0].text == sampled


def test_chat_streamed_and_not(client: openai.OpenAI, model_dir: Path) -> None:
    messages: list[Any] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "47+8="}]
    expected, _ = reference(model_dir, "system: be brief\nuser: 47+8=\nassistant:", CHAT_STOPS, seed=5, temperature=1.0)
    whole = client.chat.completions.create(model=model_dir.name, messages=messages, max_tokens=TOKENS, seed=5)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == expected
    stream = client.chat.completions.create(
        model=model_dir.name, messages=messages, max_tokens=TOKENS, seed=5, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    extra = whole.model_extra or {}
    assert extra["layerswarm"]["seed"] == 5 and [h["block"] for h in extra["layerswarm"]["route"]] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"prompt": "x" * 400}, 400, "prompt", "context_length_exceeded"),
        ({"prompt": "12", "max_tokens": 65}, 400, "max_tokens", "max_tokens_exceeded"),
        ({"prompt": "12", "max_tokens": 60, "stop": ["a"]}, 200, None, None),  # within both limits
        ({"model": "gpt-4", "prompt": "12"}, 404, "model", "model_not_found"),
        ({"prompt": "12", "temperature": 3}, 400, "temperature", "invalid_value"),
        ({"prompt": "12", "top_p": 0}, 400, "top_p", "invalid_value"),
        ({"prompt": "12", "n": 2}, 400, "n", "unsupported_parameter"),
        ({"prompt": "12", "logprobs": 2}, 400, "logprobs", "unsupported_parameter"),
        ({"prompt": "12", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
        ({"prompt": "12", "frobnicate": True}, 400, "frobnicate", "unrecognized_argument"),
        ({"prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter"),
        ({"prompt": [5, 999999]}, 400, "prompt", "invalid_token"),
    ],
)
def test_bad_requests_get_openai_errors(
    base: str, model_dir: Path, body: dict[str, Any], status: int, param: str | None, code: str | None
) -> None:
    reply = httpx.post(f"{base}/v1/completions", json={"model": model_dir.name, "max_tokens": 2, **body}, timeout=30)
    assert reply.status_code == status, reply.text
    if status == 200:
        return
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error"


def test_the_openai_package_raises_its_own_errors(client: openai.OpenAI, model_dir: Path) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="1", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_dir.name, messages=[], max_tokens=1)
    assert info.value.param == "messages"


def test_speculation_through_the_openai_package_gives_the_same_text(client: openai.OpenAI, model_dir: Path) -> None:
    """The extra parameter rides `extra_body`; greedy text is plain decoding's, streamed and not; the
    answer's `layerswarm` object counts the drafts."""
    expected, _ = reference(model_dir, "12+34=")
    for speculation in ("auto", {"k": 3}):
        whole = client.completions.create(
            model=model_dir.name,
            prompt="12+34=",
            max_tokens=TOKENS,
            temperature=0,
            extra_body={"speculation": speculation},
        )
        assert whole.choices[0].text == expected
        account = whole.model_extra["layerswarm"]["speculation"]  # type: ignore[index]
        assert account["mode"] in ("auto", "3") and account["drafted"] > 0
    chunks = client.chat.completions.create(
        model=model_dir.name,
        messages=[{"role": "user", "content": "12+34="}],
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        extra_body={"speculation": 2},
    )
    plain = client.chat.completions.create(
        model=model_dir.name, messages=[{"role": "user", "content": "12+34="}], max_tokens=TOKENS, temperature=0
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model_dir.name, prompt="1", extra_body={"speculation": "fast"})
    assert refused.value.body["param"] == "speculation"  # type: ignore[index]
