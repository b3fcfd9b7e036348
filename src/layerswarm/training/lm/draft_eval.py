"""Issue 41's measurements on one model: how well its shallow route drafts, and what per-token early exit
saves, so a family ships with its best draft depth and a calibrated exit threshold in its policy.

Drafting (lossless): self-speculative greedy decoding (models/lm/speculative.py) with the first d blocks
of the route in order, k tokens a trip, on held-out task prompts: the share of drafted tokens accepted,
tokens per verify trip, and swarm hops per token ((depth - d) per trip; plain decoding: depth per token).
Every output is compared with plain greedy decoding: `identical` must be 1.0, or the drafting is wrong.
The best draft is the (d, k) with the lowest cost per token, a trip costing its depth - d hops plus
(k + 1) x d local block evaluations at LOCAL_BLOCK_COST hops each; d at most half the depth (the
coordinator holds "a few" blocks, the swarm the rest).

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

from .metrics import Answers

DRAFT_KS = (2, 4, 8)
# A local block evaluation at the coordinator in network hops: a block of a shipped model computes one
# token in about 0.1 ms here, a loopback gRPC hop takes about 1 ms (docs/ARCHITECTURE.md's node figures).
LOCAL_BLOCK_COST = 0.1
EXIT_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999)
DRAFT_PROMPTS = 200  # prompts per (d, k): enough for the acceptance rate to two digits


@torch.no_grad()
def draft_table(
    model: DecoderLM, answers: Answers, ks: Sequence[int] = DRAFT_KS, limit: int = DRAFT_PROMPTS
) -> dict[str, Any]:
    blocks, depth = model.route(), model.cfg.depth
    prompts = answers.prompts[:limit]
    plain = generate(model.stem, blocks, model.head, prompts, answers.max_new, model.cfg.eos_id)
    rows: dict[str, Any] = {}
    for d in range(1, depth):
        for k in ks:
            stats, same = SpeculationStats(), 0
            for prompt, reference in zip(prompts, plain, strict=True):
                out = speculative_generate(
                    model.stem, blocks, model.head, prompt, answers.max_new, d, k, model.cfg.eos_id, stats
                )
                same += out == reference
            hops_per_trip = (depth - d) + (k + 1) * d * LOCAL_BLOCK_COST
            rows[f"{d}/{k}"] = {
                "draft_depth": d,
                "k": k,
                "acceptance": round(stats.acceptance, 4),
                "tokens_per_trip": round(stats.tokens_per_trip, 4),
                "swarm_hops_per_token": round((depth - d) / max(stats.tokens_per_trip, 1e-9), 3),
                "cost_per_token": round(hops_per_trip / max(stats.tokens_per_trip, 1e-9), 3),
                "identical": same / len(prompts),
            }
    allowed = [r for r in rows.values() if r["draft_depth"] <= depth // 2]
    best = min(allowed, key=lambda r: r["cost_per_token"])
    return {
        "prompts": len(prompts),
        "plain_hops_per_token": depth,
        "local_block_cost": LOCAL_BLOCK_COST,
        "table": rows,
        "best": {**best, "speedup_over_plain": round(depth / best["cost_per_token"], 3)},
    }


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
