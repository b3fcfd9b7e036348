"""Decoding modes through one swarm at batch 1 (`bench --only generation-modes`): plain decoding,
speculation with a fixed k and adaptive, and per-token early exit at the member's calibrated threshold,
in the same run on the same prompts.

The route: the shipped exit-aware decoder zoo:lm/layershuffle-exit-0 (6 blocks, 64 wide), a node process
per block and a coordinator (fp32 wire) on this machine. Two prompt sets, one stream at a time, greedy:

- task: held-out test prompts of the family's task data (training/lm/tasks.py, the test split `layerswarm
  eval` reports on; the early-exit threshold was chosen on validation prompts): exact match of each mode's
  answer, and its agreement with plain decoding's tokens;
- text: continuations of a few sentences (speculation.py's), 64 tokens, where decoding rather than
  prefill and HTTP sets the time.

Per mode: tokens/s (generated tokens over the requests' whole time), trips per token, block-hops per token
(Decode calls over tokens drawn, the end token included, as models/lm/early_exit.py counts them) and
early exits. Rounds interleave the modes, so a busy machine slows them alike.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from layerswarm.harness.procs import coordinator_cmd, spawn, stop_all
from layerswarm.harness.swarm import wait_for_swarm
from layerswarm.models import policy
from layerswarm.models.checkpoint import read_lm_manifest
from layerswarm.models.lm.tokenizer import load_tokenizer
from layerswarm.models.zoo import family_root
from layerswarm.training.lm.data import _task_counts, prompt_ids
from layerswarm.training.lm.tasks import Example, make_examples

from .fixtures import nodes
from .speculation import PROMPTS as TEXTS

MEMBER = "layershuffle-exit-0"
MODES: dict[str, dict[str, object]] = {
    "plain": {"speculation": "off", "early_exit": "off"},
    "speculation k=2": {"speculation": {"k": 2}, "early_exit": "off"},
    "speculation auto": {"speculation": "auto", "early_exit": "off"},
    "early exit (calibrated)": {"speculation": "off", "early_exit": "on"},
}
TEXT_TOKENS = 64


def _tally(answers: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    drawn = tokens + sum(a["finish_reason"] == "stop" for a in answers)  # the end tokens were drawn too
    hops = sum(a["stream"]["early_exit"]["block_hops"] for a in answers)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "trips": sum(a["stream"]["trips"] for a in answers),
        "drawn": drawn,
        "block_hops": hops,
        "exits": sum(a["stream"]["early_exit"]["exits"] for a in answers),
    }


def _round(
    http: httpx.Client, mode: dict[str, object], bodies: list[dict[str, Any]]
) -> tuple[list[Any], dict[str, Any]]:
    answers, seconds = [], 0.0
    for body in bodies:
        started = time.perf_counter()
        reply = http.post("/v1/generate", json={**body, **mode, "temperature": 0})
        seconds += time.perf_counter() - started
        reply.raise_for_status()
        answers.append(reply.json())
    return [a["token_ids"] for a in answers], _tally(answers, seconds)


def _add(total: dict[str, Any], part: dict[str, Any]) -> None:
    for key, value in part.items():
        total[key] = total.get(key, 0) + value


def run(quick: bool) -> dict[str, Any]:
    member = family_root("lm") / MEMBER
    manifest = read_lm_manifest(member)
    depth = manifest.config.depth
    tok = load_tokenizer(member / "tokenizer.json")
    n_train, n_test = _task_counts("")
    examples: list[Example] = make_examples(n_train, n_test, int(manifest.dataset.get("data_seed", 0)))[1]
    examples = examples[: 40 if quick else 200]
    max_new = max(len(tok.encode(e.answer, add_special_tokens=False).ids) for e in examples) + 1
    task_bodies = [{"prompt_ids": prompt_ids(tok, manifest.config, e), "max_tokens": max_new} for e in examples]
    text_bodies = [{"prompt": t, "max_tokens": TEXT_TOKENS} for t in TEXTS]
    sets = {"task": task_bodies, "text": text_bodies}
    totals: dict[str, dict[str, dict[str, Any]]] = {s: {m: {} for m in MODES} for s in sets}
    ids: dict[str, dict[str, list[Any]]] = {s: {} for s in sets}
    rounds = 1
    with nodes([(member, b) for b in range(depth)]) as procs:
        coordinator = spawn("bench-coordinator-modes", coordinator_cmd(member, procs, "--wire-dtype", "fp32"), 120)
        try:
            base = f"http://127.0.0.1:{coordinator.ready['port']}"
            with httpx.Client(base_url=base, timeout=120.0) as http:
                wait_for_swarm(http, depth, 120)
                _round(http, MODES["plain"], text_bodies[:1])  # warm every path once
                for _ in range(rounds):
                    for name, bodies in sets.items():
                        for mode, ask in MODES.items():
                            got, tally = _round(http, ask, bodies)
                            ids[name][mode] = got
                            _add(totals[name][mode], tally)
        finally:
            stop_all([coordinator])
    exit_policy = policy.entry(manifest, "early_exit") or {}
    return {
        "model": f"zoo:lm/{MEMBER}",
        "depth": depth,
        "threshold": exit_policy.get("threshold"),
        "calibrated_on": "validation prompts (layerswarm eval); measured here on test prompts",
        "rounds": rounds,
        "task_prompts": len(examples),
        "text_prompts": len(text_bodies),
        "text_tokens": TEXT_TOKENS,
        "task": _modes(totals["task"], ids["task"], examples, tok),
        "text": _modes(totals["text"], ids["text"], None, tok),
        "target": "early exit: >= 1.5x fewer block-hops per token than plain, <= 1 point exact-match loss",
    }


def _same(a: list[Any], b: list[Any]) -> float:
    return float(sum(x == y for x, y in zip(a, b, strict=True)) / len(a))


def _modes(
    totals: dict[str, dict[str, Any]], ids: dict[str, list[Any]], examples: list[Example] | None, tok: Any
) -> dict[str, dict[str, Any]]:
    plain = totals["plain"]
    plain_rate, plain_hops = plain["tokens"] / plain["seconds"], plain["block_hops"] / plain["drawn"]
    out: dict[str, dict[str, Any]] = {}
    for mode, t in totals.items():
        rate, hops = t["tokens"] / t["seconds"], t["block_hops"] / t["drawn"]
        row: dict[str, Any] = {
            "tokens_per_s": round(rate, 2),
            "over_plain": round(rate / plain_rate, 3),
            "trips_per_token": round(t["trips"] / t["drawn"], 3),
            "block_hops_per_token": round(hops, 3),
            "fewer_block_hops": round(plain_hops / hops, 3),
            "exits": t["exits"],
            "tokens": t["tokens"],
            "same_as_plain": round(_same(ids[mode], ids["plain"]), 4),
        }
        if examples is not None:
            hits = [tok.decode(list(g)) == e.answer for g, e in zip(ids[mode], examples, strict=True)]
            row["exact_match"] = round(sum(hits) / len(hits), 4)
        out[mode] = row
    if examples is not None:
        for row in out.values():
            row["em_loss_points"] = round(100 * (out["plain"]["exact_match"] - row["exact_match"]), 2)
    return out


def render(r: dict[str, Any]) -> list[str]:
    """The headline table: each mode on the text prompts (tokens/s) and the task prompts (exact match)."""
    lines = [
        f"**Decoding modes through a {r['depth']}-block swarm, batch 1** ({r['model']}, early-exit threshold "
        f"{r['threshold']}; {r['text_prompts']} text prompts, {r['task_prompts']} task test prompts)",
        "",
        "| mode | text: tokens/s | x plain | trips/token | block-hops/token | task: block-hops/token | fewer"
        " block-hops | exact match | EM loss (points) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, task in r["task"].items():
        text = r["text"][mode]
        lines.append(
            f"| {mode} | {text['tokens_per_s']} | {text['over_plain']} | {text['trips_per_token']} | "
            f"{text['block_hops_per_token']} | {task['block_hops_per_token']} | {task['fewer_block_hops']}x | "
            f"{task['exact_match']} | {task['em_loss_points']} |"
        )
    return lines
