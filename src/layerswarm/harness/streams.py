"""Streamed completions of a language-model family's held-out task prompts, checked exactly.

One reader for `up --family lm` and the generation chaos run: a greedy `POST /v1/completions` with
`stream: true`, read event by event until `data: [DONE]`, an error event or the connection's end. The
last chunk's `layerswarm` object is the stream's own account (rebuilt and skipped hops, the trace with
convicted nodes, the route); the text is held against the task's answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import SSEError, aconnect_sse
from prometheus_client.parser import text_string_to_metric_families

from layerswarm.models.checkpoint import read_lm_manifest
from layerswarm.training.lm.commands import model_tokenizer
from layerswarm.training.lm.data import prompt_ids
from layerswarm.training.lm.tasks import make_examples

MAX_TOKENS = 16  # a task answer is a few tokens and </s>: room to spare, so a wrong answer is seen whole


@dataclass
class Task:
    prompt_ids: list[int]
    answer: str


@dataclass
class StreamResult:
    done: bool = False  # its events ended with [DONE]
    error: str | None = None
    status: int | None = None  # the HTTP status (None: no answer at all)
    text: str = ""
    correct: bool = False
    chunks: int = 0
    in_flight_at_kill: bool = False
    rebuilt: int = 0
    skipped: int = 0
    elapsed_s: float = 0.0
    drafted: int = 0
    accepted: int = 0
    trips: int = 0
    trace: list[dict[str, Any]] = field(default_factory=list)  # rebuilt / skipped / convicted / hop_failed
    route: list[str | None] = field(default_factory=list)  # the node of each position at the end

    @property
    def convicted(self) -> list[str]:
        """The nodes this stream's checks (or another's) caught lying while it ran."""
        return [str(e.get("node")) for e in self.trace if e.get("kind") == "convicted"]

    @property
    def tainted_tokens(self) -> int:
        """Tokens sampled from a liar's states before it was caught (they were sent: they stay)."""
        return sum(int(e.get("tainted_tokens", 0)) for e in self.trace if e.get("kind") == "convicted")


def task_prompts(member: Path, count: int, seed: int) -> list[Task]:
    """Held-out generated task prompts (drawn with a seed apart from the training data's) and their answers."""
    manifest = read_lm_manifest(member)
    tok = model_tokenizer(member, manifest)
    _, examples = make_examples(0, count, seed=12345 + seed)
    return [Task(prompt_ids(tok, manifest.config, e), e.answer) for e in examples]


async def stream_one(
    client: httpx.AsyncClient,
    model: str,
    task: Task,
    result: StreamResult,
    first: asyncio.Event,
    speculation: str = "off",
) -> None:
    """One completion, read event by event until [DONE] (or an error event, or the connection's end)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": task.prompt_ids,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    body["speculation"] = int(speculation) if speculation.isdigit() else speculation
    started = time.monotonic()
    try:
        async with aconnect_sse(client, "POST", "/v1/completions", json=body) as source:
            result.status = source.response.status_code
            if source.response.status_code != 200:
                result.error = f"HTTP {source.response.status_code}: {(await source.response.aread())[:200]!r}"
                return
            async for event in source.aiter_sse():
                if event.data == "[DONE]":
                    result.done = True
                    break
                chunk = json.loads(event.data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    break
                result.chunks += 1
                first.set()
                for choice in chunk.get("choices", []):
                    result.text += choice.get("text") or ""
                extras = chunk.get("layerswarm")
                if extras:
                    _read_extras(result, extras)
    except (httpx.HTTPError, SSEError, ValueError) as exc:  # this stream's outcome, reported in the summary
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.elapsed_s = round(time.monotonic() - started, 3)
        result.correct = result.done and result.text.strip() == task.answer


def _read_extras(result: StreamResult, extras: dict[str, Any]) -> None:
    result.rebuilt, result.skipped = int(extras["rebuilt"]), int(extras["skipped"])
    spec = extras.get("speculation") or {}
    result.drafted, result.accepted = int(spec.get("drafted", 0)), int(spec.get("accepted", 0))
    result.trips = int(extras.get("trips", 0))
    result.trace = list(extras.get("trace") or [])
    result.route = [slot.get("node") for slot in extras.get("route") or []]


def failover_counts(metrics: str) -> dict[str, float]:
    """The coordinator's own failover counters (layerswarm_gen_failovers_total{kind=...})."""
    return labelled_counter(metrics, "layerswarm_gen_failovers", "kind")


def labelled_counter(metrics: str, family_name: str, label: str) -> dict[str, float]:
    """A Prometheus counter family's totals by one label's value ("" for an unlabelled counter)."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name == family_name:
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels.get(label, "")] = sample.value
    return counts
