"""Issue 41's measurements on one model: how well its shallow route drafts, and what per-token early exit
saves, so a family ships with its best draft depth and a calibrated exit threshold in its policy.

Drafting (lossless): self-speculative greedy decoding (models/lm/speculative.py) with the first d blocks
of the route in order, k tokens a trip, on held-out task prompts (short answers) and text prompts (the first
TEXT_PROMPT tokens of held-out paragraphs, TEXT_NEW tokens generated): the share of drafted tokens accepted
and the tokens a verify trip yields. Every output is compared with plain greedy decoding: `identical` must
be 1.0, or the drafting is wrong. Cost per token, in network hops, as the swarm runs it
(coordinator/generation/speculate.py): plain decoding takes the whole route, depth hops, a token; a
speculative round drafts k tokens at the coordinator (each the first d blocks plus the stem and head,
which cost about one more block: (d + 1) x LOCAL_BLOCK_COST hops) and sends k + 1 tokens through the whole
route in one trip (depth hops), so it costs depth + k x (d + 1) x LOCAL_BLOCK_COST hops for its tokens per
trip. The best draft is the (d, k) with the largest ratio, d at most DRAFT_MAX_SHARE of the depth: the
coordinator holds a few blocks to draft with, not most of the model.

Early exit (lossy, CALM): for each confidence threshold, exact match and the share of block-hops saved on
the validation prompts; the threshold chosen is the lowest one that loses at most `max_em_loss` of exact
match there, then measured on the test prompts (never tuned on them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from layerswarm.models.lm.early_exit import ExitStats, early_exit_generate
from layerswarm.models.lm.generate import generate
from layerswarm.models.lm.model import DecoderLM
from layerswarm.models.lm.speculative import SpeculationStats, speculative_generate

from .data import TokenRows
from .metrics import Answers

DRAFT_KS = (2, 4, 6)
# A local block evaluation at the coordinator in network hops: a block of a shipped model computes one
# token in about 0.1 ms here, a loopback gRPC hop takes about 1 ms (docs/ARCHITECTURE.md's node figures).
LOCAL_BLOCK_COST = 0.1
DRAFT_MAX_SHARE = 2 / 3  # the deepest draft considered, as a share of the depth (4 of 6 blocks)
EXIT_THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.999)
DRAFT_PROMPTS = 60  # task prompts per (d, k): a few hundred drafted tokens with the text prompts
TEXT_PROMPTS, TEXT_PROMPT, TEXT_NEW = 24, 16, 32  # text prompts per (d, k), their tokens, tokens generated
EXIT_PROMPTS = 500  # validation prompts the exit threshold is chosen on


@torch.no_grad()
def draft_table(
    model: DecoderLM,
    answers: Answers,
    text: TokenRows | None = None,
    ks: Sequence[int] = DRAFT_KS,
    limit: int = DRAFT_PROMPTS,
) -> dict[str, Any]:
    depth, eos = model.cfg.depth, model.cfg.eos_id
    sources = {"tasks": (answers.prompts[:limit], answers.max_new)}
    if text is not None:
        sources["text"] = ([row[:TEXT_PROMPT].tolist() for row in text.ids[:TEXT_PROMPTS]], TEXT_NEW)
    blocks = model.route()
    plain = {name: generate(model.stem, blocks, model.head, p, n, eos) for name, (p, n) in sources.items()}
    rows: dict[str, Any] = {}
    for d in range(1, depth):
        for k in ks:
            row: dict[str, Any] = {"draft_depth": d, "k": k}
            total = SpeculationStats()
            for name, (prompts, max_new) in sources.items():
                stats, same = SpeculationStats(), 0
                for prompt, reference in zip(prompts, plain[name], strict=True):
                    out = speculative_generate(model.stem, blocks, model.head, prompt, max_new, d, k, eos, stats)
                    same += out == reference
                row[name] = _summary(stats) | {"identical": same / len(prompts)}
                for field in ("trips", "drafted", "accepted", "emitted"):
                    setattr(total, field, getattr(total, field) + getattr(stats, field))
            trip_cost = depth + k * (d + 1) * LOCAL_BLOCK_COST
            row.update(_summary(total))
            row["speedup"] = round(depth * total.tokens_per_trip / trip_cost, 3)
            rows[f"{d}/{k}"] = row
    deepest = max(1, int(depth * DRAFT_MAX_SHARE))
    best = max((r for r in rows.values() if r["draft_depth"] <= deepest), key=lambda r: r["speedup"])
    return {"local_block_cost": LOCAL_BLOCK_COST, "max_share": DRAFT_MAX_SHARE, "table": rows, "best": best}


def _summary(stats: SpeculationStats) -> dict[str, float]:
    return {"acceptance": round(stats.acceptance, 4), "tokens_per_trip": round(stats.tokens_per_trip, 4)}


@torch.no_grad()
def calibrate_early_exit(
    model: DecoderLM,
    val: Answers,
    test: Answers,
    max_em_loss: float = 0.01,
    thresholds: Sequence[float] = EXIT_THRESHOLDS,
    min_blocks: int = 1,
) -> dict[str, Any]:
    blocks, eos = model.route(), model.cfg.eos_id

    def run(answers: Answers, threshold: float | None) -> dict[str, float]:
        stats = ExitStats()
        if threshold is None:
            outputs = generate(model.stem, blocks, model.head, answers.prompts, answers.max_new, eos)
        else:
            outputs = early_exit_generate(
                model.stem, blocks, model.head, answers.prompts, answers.max_new, threshold, eos, min_blocks, stats
            )
        saved = stats.hops_saved
        return {
            "em": float(answers.hits(outputs).mean()),
            "hops_saved": round(saved, 4),
            "hop_speedup": round(1 / (1 - saved), 3) if saved < 1 else float("inf"),
        }

    full_val = run(val, None)
    curve = {str(t): run(val, t) for t in thresholds}
    fine = [t for t in thresholds if full_val["em"] - curve[str(t)]["em"] <= max_em_loss]
    chosen = min(fine) if fine else None
    full_test = run(test, None)
    result: dict[str, Any] = {
        "max_em_loss": max_em_loss,
        "min_blocks": min_blocks,
        "validation": {"full": full_val, "by_threshold": curve},
        "threshold": chosen,
        "test": {"full": full_test},
    }
    if chosen is not None:
        exited = run(test, chosen)
        result["test"]["exit"] = exited
        result["test"]["em_loss"] = round(full_test["em"] - exited["em"], 4)
    return result
