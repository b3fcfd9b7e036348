"""Self-speculative decoding through a swarm at batch 1 (part of `bench --only generation`): plain decoding,
speculation with a fixed k, and adaptive k, on the same swarm in the same run.

The route: the shipped exit-aware decoder (trained with an early-exit loss, so its first blocks draft
for it: LayerSkip's recipe), a node process per block and a coordinator (fp32 wire) on this machine,
drafting with the depth its evaluated policy names. One stream at a time, greedy, TOKENS tokens from each
of the PROMPTS; a stream's time is its whole answer (`POST /v1/generate`: prefill, HTTP and every token),
the same for every mode. Rounds interleave the modes, so a busy machine slows them alike. Each mode's
tokens are compared with plain decoding's: greedy speculation must give the very same ones.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from layerswarm.harness.procs import Proc, coordinator_cmd, spawn, stop_all
from layerswarm.harness.swarm import wait_for_swarm
from layerswarm.models import policy
from layerswarm.models.checkpoint import read_lm_manifest
from layerswarm.models.zoo import family_root

from .fixtures import nodes

MEMBER = "layershuffle-exit-1"  # the member whose draft `layerswarm eval` found best (acceptance 0.65)
# Text this small model continues for most of TOKENS before its end token (the answers to whole sentences
# are a few tokens: prefill and HTTP would then weigh more than the decoding being compared).
PROMPTS = (
    "It is",
    "When the",
    "Strings can be",
    "A function definition introduces the function name in the current scope",
)
TOKENS = 64
MODES: dict[str, object] = {"plain": "off", "k=2": {"k": 2}, "k=4": {"k": 4}, "auto": "auto"}


def one_round(http: httpx.Client, speculation: object) -> dict[str, Any]:
    """Every prompt once, one stream at a time: tokens, seconds, trips, drafts and the token ids."""
    tokens = trips = drafted = accepted = 0
    seconds, ids = 0.0, []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "speculation": speculation}
        started = time.perf_counter()
        reply = http.post("/v1/generate", json=body)
        seconds += time.perf_counter() - started
        reply.raise_for_status()
        answer = reply.json()
        stream, spec = answer["stream"], answer["stream"]["speculation"]
        tokens += answer["usage"]["completion_tokens"]
        trips += stream["trips"]
        drafted, accepted = drafted + spec["drafted"], accepted + spec["accepted"]
        ids.append(answer["token_ids"])
    return {"tokens": tokens, "seconds": seconds, "trips": trips, "drafted": drafted, "accepted": accepted, "ids": ids}


def member_dir() -> Path:
    return family_root("lm") / MEMBER


def run(quick: bool) -> dict[str, Any]:
    member = member_dir()
    with nodes([(member, b) for b in range(read_lm_manifest(member).config.depth)]) as procs:
        return compare(member, procs, 2 if quick else 6, target=2.0)


def compare(member: Path, procs: list[Proc], rounds: int, target: float, *extra: str) -> dict[str, Any]:
    """A coordinator (in this network namespace) over the node processes `procs`, and every mode once a
    round, `rounds` rounds after a warm-up one. `extra`: more coordinator flags (the swarm token)."""
    manifest = read_lm_manifest(member)
    depth = manifest.config.depth
    totals: dict[str, dict[str, Any]] = {
        m: {"tokens": 0, "seconds": 0.0, "trips": 0, "drafted": 0, "accepted": 0} for m in MODES
    }
    identical = True
    coordinator = spawn("bench-coordinator-spec", coordinator_cmd(member, procs, "--wire-dtype", "fp32", *extra), 120)
    try:
        base = f"http://127.0.0.1:{coordinator.ready['port']}"
        with httpx.Client(base_url=base, timeout=120.0) as http:
            wait_for_swarm(http, depth, 120)
            one_round(http, "off")  # warm every path once
            for _ in range(rounds):
                plain_ids = None
                for mode, speculation in MODES.items():
                    got = one_round(http, speculation)
                    plain_ids = got["ids"] if plain_ids is None else plain_ids
                    identical = identical and got.pop("ids") == plain_ids
                    for key, value in got.items():
                        totals[mode][key] += value
    finally:
        stop_all([coordinator])
    return {
        "model": f"zoo:lm/{MEMBER}",
        "depth": depth,
        "draft_depth": (policy.entry(manifest, "draft") or {}).get("draft_depth"),
        "tokens_per_stream": TOKENS,
        "prompts": len(PROMPTS),
        "rounds": rounds,
        "identical_to_plain": identical,
        "modes": _modes(totals),
        "target_over_plain": target,
    }


def _modes(totals: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    plain = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    out = {}
    for mode, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        out[mode] = {
            "tokens_per_s": round(rate, 2),
            "over_plain": round(rate / plain, 3),
            "trips_per_token": round(t["trips"] / t["tokens"], 3),
            "acceptance": round(t["accepted"] / t["drafted"], 3) if t["drafted"] else None,
            "tokens": t["tokens"],
        }
    return out
