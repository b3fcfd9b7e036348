"""The paper's experiments on language models: perplexity and exact match of one model in order and in
random block orders, pruned to k of n blocks, merged from several members, and the members' ensemble.

Per model: sequential; arbitrary (random orders, mean ± std); pruned (k blocks: spread evenly in order,
and random subsets in random order). Per group of two or more members of one family and variant: merged
models (each block index from a member assigned at random, blocks spread evenly over the members, run in
random order, the first member's stem and head) and the ensemble (mean of the members' probabilities,
each member in its own random order). Then the targets of issue 40, checked on the report.
"""

from __future__ import annotations

import logging
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer
from tqdm import tqdm

from layerswarm.models.checkpoint import Manifest
from layerswarm.models.config import is_shuffle_robust
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.model import DecoderBlock, DecoderLM
from layerswarm.models.paths import spread_evenly

from .data import LMData
from .metrics import Answers, Parts, Scores, ensemble_scores, route_scores

log = logging.getLogger(__name__)

# Issue 40's targets for a shipped family (ratios of perplexity: lower is better; of exact match: higher).
ARBITRARY_PPL_MAX = 1.10  # arbitrary-order perplexity / sequential
MERGED_PPL_MAX = 1.10  # merged models' perplexity / the members' own (both in arbitrary order)
ARBITRARY_EM_MIN = 0.95  # arbitrary-order exact match / sequential
# A baseline "visibly degrades" when arbitrary order costs it more than this (perplexity ratio) ...
BASELINE_DEGRADED_PPL = 1.5
# ... or it keeps at most this share of its exact match.
BASELINE_DEGRADED_EM = 0.5


@dataclass
class LMEvalPlan:
    orders: int = 10  # random orders per arbitrary-order figure
    merges: int = 20  # random merged models per group
    prune_trials: int = 3  # random subsets per pruned arbitrary-order figure
    ensemble_draws: int = 3  # random orders per member behind the ensemble figure
    seed: int = 0


@dataclass
class Member:
    name: str
    model: DecoderLM
    manifest: Manifest[LMConfig]

    @property
    def parts(self) -> Parts:
        return Parts(self.model.stem, self.model.head)

    @property
    def blocks(self) -> list[DecoderBlock]:
        return self.model.route()


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def summarise(rows: Sequence[Scores]) -> dict[str, dict[str, float]]:
    return {key: summary([r[key] for r in rows]) for key in rows[0]}


def mean_scores(rows: Sequence[Scores]) -> Scores:
    return {key: statistics.fmean(r[key] for r in rows) for key in rows[0]}


def evaluate_members(members: Sequence[Member], data: LMData, tok: Tokenizer, plan: LMEvalPlan) -> dict[str, Any]:
    rng = random.Random(plan.seed)
    answers = Answers(data.test_examples, tok, members[0].model.cfg) if data.test_examples else None
    report: dict[str, Any] = {
        "dataset": data.describe(),
        "plan": vars(plan),
        "models": {},
        "groups": {},
    }
    for m in tqdm(members, desc="models", unit="model", disable=None):
        report["models"][m.name] = _evaluate_one(m, data, answers, plan, rng)
    for key, group in _groups(members).items():
        report["groups"][key] = _evaluate_group(group, report["models"], data, answers, plan, rng)
    report["targets"] = check_targets(report)
    return report


def _evaluate_one(
    m: Member, data: LMData, answers: Answers | None, plan: LMEvalPlan, rng: random.Random
) -> dict[str, Any]:
    blocks, depth = m.blocks, len(m.blocks)
    arbitrary = [route_scores(m.parts, rng.sample(blocks, depth), data, answers) for _ in range(plan.orders)]
    pruned: dict[str, dict[str, Scores]] = {}
    for k in range(1, depth):
        seq = route_scores(m.parts, [blocks[i] for i in spread_evenly(range(depth), k)], data, answers)
        arb = [route_scores(m.parts, rng.sample(blocks, k), data, answers) for _ in range(plan.prune_trials)]
        pruned[str(k)] = {"sequential": seq, "arbitrary": mean_scores(arb)}
    return {
        "model_id": m.manifest.model_id,
        "family_id": m.manifest.family_id,
        "variant": m.manifest.variant,
        "sequential": route_scores(m.parts, blocks, data, answers),
        "arbitrary": summarise(arbitrary),
        "pruned": pruned,
    }


def _evaluate_group(
    members: list[Member],
    per_model: dict[str, Any],
    data: LMData,
    answers: Answers | None,
    plan: LMEvalPlan,
    rng: random.Random,
) -> dict[str, Any]:
    first, depth = members[0], len(members[0].blocks)
    merged, merged_seq = [], []
    for _ in range(plan.merges):
        owners = [i % len(members) for i in range(depth)]
        rng.shuffle(owners)
        blocks = [members[o].blocks[i] for i, o in enumerate(owners)]
        merged_seq.append(route_scores(first.parts, blocks, data, answers))
        merged.append(route_scores(first.parts, rng.sample(blocks, depth), data, answers))
    draws = [
        ensemble_scores([(m.parts, rng.sample(m.blocks, depth)) for m in members], data, answers)
        for _ in range(plan.ensemble_draws)
    ]
    rows = [per_model[m.name] for m in members]
    return {
        "family_id": first.manifest.family_id,
        "variant": first.manifest.variant,
        "members": [m.name for m in members],
        "sequential": mean_scores([r["sequential"] for r in rows]),
        "arbitrary": mean_scores([{k: v["mean"] for k, v in r["arbitrary"].items()} for r in rows]),
        "merged": summarise(merged),
        "merged_sequential": summarise(merged_seq),
        "ensemble": summarise(draws),
        "ensemble_sequential": ensemble_scores([(m.parts, m.blocks) for m in members], data, answers),
    }


def _groups(members: Sequence[Member]) -> dict[str, list[Member]]:
    groups: dict[str, list[Member]] = {}
    for m in members:
        groups.setdefault(f"{m.manifest.family_id}/{m.manifest.variant}", []).append(m)
    return {k: v for k, v in groups.items() if len(v) >= 2}


def _ratios(numerator: Scores, denominator: Scores, prefix: str) -> dict[str, float]:
    return {k: numerator[k] / denominator[k] for k in numerator if k.startswith(prefix) and denominator.get(k)}


def check_targets(report: dict[str, Any]) -> dict[str, Any]:
    """Issue 40's targets on a report: per shuffle-robust group, arbitrary / sequential perplexity (every
    source) and exact match, merged / members' perplexity; per baseline model, how much arbitrary order
    costs it. Every check states its value, its bound and whether it holds."""
    out: dict[str, Any] = {}
    for key, g in report["groups"].items():
        if not is_shuffle_robust(g["variant"]):
            continue
        merged = {k: v["mean"] for k, v in g["merged"].items()}
        checks = {}
        for k, v in _ratios(g["arbitrary"], g["sequential"], "ppl/").items():
            checks[f"arbitrary_over_sequential_{k}"] = _check(v, ARBITRARY_PPL_MAX, "<=")
        for k, v in _ratios(merged, g["arbitrary"], "ppl/").items():
            checks[f"merged_over_members_{k}"] = _check(v, MERGED_PPL_MAX, "<=")
        if "em" in g["sequential"]:
            checks["arbitrary_over_sequential_em"] = _check(
                g["arbitrary"]["em"] / max(g["sequential"]["em"], 1e-9), ARBITRARY_EM_MIN, ">="
            )
            checks["merged_over_members_em"] = _check(
                merged["em"] / max(g["arbitrary"]["em"], 1e-9), ARBITRARY_EM_MIN, ">="
            )
        out[key] = checks
    for name, m in report["models"].items():
        if m["variant"] != "baseline":
            continue
        arbitrary = {k: v["mean"] for k, v in m["arbitrary"].items()}
        checks = {}
        for k, v in _ratios(arbitrary, m["sequential"], "ppl/").items():
            checks[f"arbitrary_over_sequential_{k}"] = _check(v, BASELINE_DEGRADED_PPL, ">")
        if "em" in m["sequential"]:
            checks["arbitrary_over_sequential_em"] = _check(
                arbitrary["em"] / max(m["sequential"]["em"], 1e-9), BASELINE_DEGRADED_EM, "<"
            )
        out[name] = checks
    return out


def _check(value: float, bound: float, op: str) -> dict[str, Any]:
    holds = {"<=": value <= bound, ">=": value >= bound, ">": value > bound, "<": value < bound}[op]
    return {"value": round(value, 4), "target": f"{op} {bound}", "holds": holds}
