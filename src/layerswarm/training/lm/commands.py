"""What `layerswarm train`, `family`, `eval` and `import-hf` do for language models, from typed requests
(the CLI turns its flags into these in cli/lm.py).

A model directory of a decoder is the classifiers' format (models/checkpoint.py): manifest, stem, head and
one safetensors file per block, plus tokenizer.json, every file hashed; the recipe, data spec, training
history and test metrics are in the manifest, the measured policy (draft depth, exit threshold, min depth)
in its policy section.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from layerswarm.models.checkpoint import (
    TOKENIZER,
    Lineage,
    Manifest,
    load_lm,
    read_lm_manifest,
    save_model,
    verified_file,
)
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.hf_import import import_hf_lm
from layerswarm.models.lm.model import DecoderLM
from layerswarm.models.lm.tokenizer import TOKENIZER_FILE, check_tokenizer, load_tokenizer
from layerswarm.models.policy import write_entry

from ..family import run_parallel
from .data import LMData, encode, load_corpus
from .draft_eval import EXIT_PROMPTS, calibrate_early_exit, draft_table
from .evaluate import LMEvalPlan, Member, evaluate_members
from .metrics import Answers, Parts, route_scores
from .recipe import LMRecipe
from .tokenizer import train_bpe
from .trainer import LMTrainer

log = logging.getLogger(__name__)

DRAFT_POLICY = "draft"  # policy keys this module writes: the best self-speculative draft ...
EARLY_EXIT_POLICY = "early_exit"  # ... the calibrated per-token exit threshold ...
MIN_BLOCKS_POLICY = "min_blocks"  # ... and the fewest blocks within a margin of full depth (models/policy.py's key)


@dataclass(frozen=True)
class LMSize:
    """A from-scratch decoder's shape (an --init model keeps its own)."""

    dim: int = 64
    depth: int = 6
    heads: int = 4
    kv_heads: int = 2
    hidden_dim: int = 0  # 0: swiglu_hidden(dim)
    context: int = 128
    vocab_size: int = 512


@dataclass
class TrainLMRequest:
    data: str
    out: Path
    recipe: LMRecipe
    size: LMSize = field(default_factory=LMSize)
    init: str | None = None  # a model directory (fine-tune) or hf:PATH (an imported checkpoint)
    data_seed: int = 0
    command: str = ""


def model_tokenizer(model_dir: str | os.PathLike[str], manifest: Manifest[LMConfig]) -> Tokenizer:
    """A decoder's tokenizer, after checking its hash against the manifest."""
    tok = load_tokenizer(verified_file(model_dir, manifest, TOKENIZER))
    check_tokenizer(tok, manifest.config, str(model_dir))
    return tok


def train_lm(req: TrainLMRequest) -> Manifest[LMConfig]:
    started = time.perf_counter()
    if req.recipe.threads:
        torch.set_num_threads(req.recipe.threads)
    corpus = load_corpus(req.data, req.data_seed)
    model, tok, lineage = _starting_model(req, corpus.tokenizer_texts())
    data = encode(corpus, tok, model.cfg, req.recipe.text_len)
    log.info("data: %s", json.dumps(data.describe()))
    trainer = LMTrainer(model, data, req.recipe)
    trainer.fit(on_record=lambda r: tqdm.write(_describe(r), file=sys.stderr))
    model.eval()
    metrics = quick_metrics(model, data, tok)
    recipe = {
        **asdict(req.recipe),
        "init": req.init,
        "size": asdict(req.size) if req.init is None else None,
        "command": req.command,
        "history": trainer.history,
        "stopped": trainer.stopped,
        "steps": trainer.step,
        "seconds": round(time.perf_counter() - started, 1),
    }
    dataset = {**data.describe(), "data_seed": req.data_seed}
    req.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(req.out / TOKENIZER_FILE))
    manifest: Manifest[LMConfig] = save_model(model, req.out, lineage, recipe=recipe, dataset=dataset, metrics=metrics)
    return manifest


def _starting_model(req: TrainLMRequest, texts: Any) -> tuple[DecoderLM, Tokenizer, Lineage]:
    """A fresh model and a tokenizer trained on the corpus; a fine-tune of a model directory; or an import."""
    variant = req.recipe.variant
    if req.init and req.init.startswith("hf:"):
        path = Path(req.init[3:])
        model, root = import_hf_lm(path, variant)
        tok = hf_tokenizer(path, model.cfg)
        return model, tok, Lineage(root=root, parent=None, source="huggingface")
    if req.init:
        parent, manifest = load_lm(req.init)
        tok = model_tokenizer(req.init, manifest)
        model = DecoderLM(parent.cfg.replace(variant=variant))
        model.load_state_dict(parent.state_dict())
        return model, tok, Lineage(root=manifest.lineage.root, parent=manifest.model_id, source="model")
    tok = train_bpe(texts, req.size.vocab_size)
    size = req.size
    cfg = LMConfig(
        vocab_size=tok.get_vocab_size(),
        dim=size.dim,
        depth=size.depth,
        heads=size.heads,
        kv_heads=size.kv_heads,
        hidden_dim=size.hidden_dim,
        max_seq_len=size.context,
        variant=variant,
    )
    torch.manual_seed(req.recipe.seed)
    return DecoderLM(cfg), tok, Lineage(source="scratch")


def hf_tokenizer(path: Path, cfg: LMConfig, fallback: Path | None = None) -> Tokenizer:
    """An imported checkpoint's tokenizer.json (or `fallback`), checked against its config."""
    source = path / TOKENIZER_FILE if (path / TOKENIZER_FILE).is_file() else fallback
    if source is None or not source.is_file():
        raise ValueError(f"{path}: no {TOKENIZER_FILE} (a fast tokenizer); name one with --tokenizer")
    tok = load_tokenizer(source)
    check_tokenizer(tok, cfg, str(source))
    return tok


def import_hf(
    path: Path, out: Path, variant: str, tokenizer: Path | None = None, context: int | None = None
) -> Manifest[LMConfig]:
    """A Hugging Face checkpoint as a model directory, untrained by us (lineage: the weights' hash)."""
    model, root = import_hf_lm(path, variant, context)
    tok = hf_tokenizer(path, model.cfg, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / TOKENIZER_FILE))
    recipe = {"imported_from": str(path)}
    manifest: Manifest[LMConfig] = save_model(model, out, Lineage(root=root, source="huggingface"), recipe=recipe)
    return manifest


def quick_metrics(model: DecoderLM, data: LMData, tok: Tokenizer, orders: int = 3) -> dict[str, float]:
    """Test perplexity and exact match in order and over a few random orders (the full study is eval's)."""
    answers = Answers(data.test_examples, tok, model.cfg) if data.test_examples else None
    parts, blocks = Parts(model.stem, model.head), model.route()
    gen = torch.Generator().manual_seed(0)
    seq = route_scores(parts, blocks, data, answers)
    arb = [
        route_scores(parts, [blocks[i] for i in torch.randperm(len(blocks), generator=gen).tolist()], data, answers)
        for _ in range(orders)
    ]
    out = {f"test_sequential_{k}": round(v, 4) for k, v in seq.items()}
    out.update({f"test_arbitrary_{k}": round(sum(a[k] for a in arb) / orders, 4) for k in seq})
    return out


def _describe(record: dict[str, float]) -> str:
    parts = [f"step {int(record['step'])}", f"train {record['train_loss']:.3f}", f"val {record['val_loss']:.3f}"]
    if "val_loss_arbitrary" in record:
        parts.append(f"val arbitrary {record['val_loss_arbitrary']:.3f}")
    parts.append(f"{record['seconds']:.0f} s" + (" (kept)" if record.get("kept") else ""))
    return "  ".join(parts)


# --- family ----------------------------------------------------------------------------------------


@dataclass
class FamilyLMRequest:
    base: Path
    out: Path
    members: int = 4
    prefix: str = "layershuffle"
    variant: str = "layershuffle"
    time_budget_s: float = 240.0
    lr: float = 1e-3
    first_seed: int = 1
    jobs: int = 2
    threads: int = 1
    data: str | None = None
    overwrite: bool = False
    exit_loss: float | None = None  # None: the base's
    exit_dropout: float | None = None


def family_lm(req: FamilyLMRequest) -> list[Path]:
    """Fine-tune `members` siblings of `base` (seeds first_seed + i), `jobs` at a time, each a
    `layerswarm train` process: they share the base's lineage root, so their blocks mix."""
    base = read_lm_manifest(req.base)
    data = req.data or base.dataset.get("spec")
    if not isinstance(data, str):
        raise ValueError("--data is needed (the base manifest names no dataset)")
    # The base's data handling and exit-aware training carry over; what a member changes is given above.
    keys = ("exit_loss", "exit_dropout", "text_len", "text_share", "batch_tokens", "warmup_steps", "budget_clock")
    inherited = {k: base.recipe[k] for k in keys if k in base.recipe}
    for key, asked in (("exit_loss", req.exit_loss), ("exit_dropout", req.exit_dropout)):
        if asked is not None:
            inherited[key] = asked
    outs = [req.out / f"{req.prefix}-{i}" for i in range(req.members)]
    commands = []
    for i, out in enumerate(outs):
        command = [sys.executable, "-m", "layerswarm", "train", "--data", data, "--init", str(req.base)]
        command += ["--out", str(out)]
        command += ["--variant", req.variant, "--time-budget", str(req.time_budget_s), "--lr", str(req.lr)]
        command += ["--seed", str(req.first_seed + i), "--threads", str(req.threads)]
        command += ["--data-seed", str(base.dataset.get("data_seed", 0))]
        for key, value in inherited.items():
            command += ["--" + key.replace("_", "-"), str(value)]
        if req.overwrite:
            command.append("--overwrite")
        commands.append(command)
    failed = run_parallel(commands, req.jobs)
    if failed:
        raise RuntimeError(f"{failed} member(s) failed")
    return outs


# --- eval ------------------------------------------------------------------------------------------


@dataclass
class EvalLMRequest:
    model_dirs: list[Path]
    data: str | None = None
    plan: LMEvalPlan = field(default_factory=LMEvalPlan)
    json_out: Path | None = None
    write_policy: bool = True
    drafts: bool = True  # issue 41: draft acceptance by depth, and the per-token early exit
    max_em_loss: float = 0.01
    min_depth_margin: float = 0.01


def eval_lm(req: EvalLMRequest) -> dict[str, Any]:
    members = []
    for model_dir in req.model_dirs:
        model, manifest = load_lm(model_dir)
        members.append(Member(str(model_dir).rstrip("/").rsplit("/", 1)[-1], model, manifest))
    first = members[0].manifest
    spec = req.data or first.dataset.get("spec")
    if not isinstance(spec, str):
        raise ValueError("--data is needed (the manifest names no dataset)")
    tok = model_tokenizer(req.model_dirs[0], first)
    for m, model_dir in zip(members, req.model_dirs, strict=True):
        if model_tokenizer(model_dir, m.manifest).to_str() != tok.to_str():
            raise ValueError(f"{model_dir} has another tokenizer than {req.model_dirs[0]}: evaluate them apart")
    corpus = load_corpus(spec, int(first.dataset.get("data_seed", 0)))
    data = encode(corpus, tok, first.config, int(first.recipe.get("text_len", LMRecipe.text_len)))
    started = time.perf_counter()
    report = evaluate_members(members, data, tok, req.plan)
    if req.drafts and data.test_examples:
        report["drafting"] = {}
        for m in members:
            began = time.perf_counter()
            report["drafting"][m.name] = _drafting(m, data, tok, req.max_em_loss)
            log.info("%s: drafts and early exits measured in %.0f s", m.name, time.perf_counter() - began)
    report["seconds"] = round(time.perf_counter() - started, 1)
    if req.write_policy:
        _write_policies(req.model_dirs, members, report, req.min_depth_margin)
    if req.json_out:
        req.json_out.parent.mkdir(parents=True, exist_ok=True)
        req.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _drafting(m: Member, data: LMData, tok: Tokenizer, max_em_loss: float) -> dict[str, Any]:
    cfg = m.model.cfg
    test = Answers(data.test_examples, tok, cfg)
    val = Answers(data.val_examples[:EXIT_PROMPTS], tok, cfg)
    text = next((rows for rows in data.test if rows.source == "text"), None)
    draft = draft_table(m.model, test, text)
    return {"draft": draft, "early_exit": calibrate_early_exit(m.model, val, test, max_em_loss)}


def _write_policies(model_dirs: list[Path], members: list[Member], report: dict[str, Any], margin: float) -> None:
    for model_dir, m in zip(model_dirs, members, strict=True):
        drafting = report.get("drafting", {}).get(m.name)
        if drafting:
            write_entry(model_dir, DRAFT_POLICY, drafting["draft"]["best"])
            exit_rule = drafting["early_exit"]
            write_entry(
                model_dir,
                EARLY_EXIT_POLICY,
                {k: exit_rule[k] for k in ("threshold", "max_em_loss", "min_blocks")} | {"test": exit_rule["test"]},
            )
        write_entry(model_dir, MIN_BLOCKS_POLICY, min_depth(report, m, margin))


def min_depth(report: dict[str, Any], m: Member, margin: float) -> dict[str, Any]:
    """The fewest blocks whose exact match (else the served order's perplexity) stays within `margin` (a
    share) of full depth, in the order the model is served in (arbitrary for LayerShuffle)."""
    row = report["models"][m.name]
    order = "arbitrary" if m.manifest.config.shuffle_robust else "sequential"
    full = {k: v["mean"] for k, v in row["arbitrary"].items()} if order == "arbitrary" else row["sequential"]
    curve = {int(k): v[order] for k, v in row["pruned"].items()}
    curve[m.manifest.config.depth] = full
    key = "em" if "em" in full else min(k for k in full if k.startswith("ppl/"))
    if key == "em":
        fine = [k for k, s in curve.items() if s[key] >= full[key] - margin]
    else:
        fine = [k for k, s in curve.items() if s[key] <= full[key] * (1 + margin)]
    value = min(fine)
    return {
        "value": value,
        "margin": margin,
        "order": order,
        "metric": key,
        "curve": {str(k): round(curve[k][key], 4) for k in sorted(curve)},
    }


def render_table(report: dict[str, Any]) -> str:
    """The report as markdown: each model and group in order and arbitrary order, then the targets."""
    keys = sorted(
        {k for m in report["models"].values() for k in m["sequential"] if "/" not in k or k.startswith("ppl/")}
    )
    lines = [
        "| model | variant | " + " | ".join(f"{k} seq / arb" for k in keys) + " |",
        "| --- | --- |" + " --- |" * len(keys),
    ]
    for name, m in report["models"].items():
        cells = [f"{m['sequential'][k]:.4g} / {m['arbitrary'][k]['mean']:.4g}" for k in keys]
        lines.append(f"| {name} | {m['variant']} | " + " | ".join(cells) + " |")
    for g in report["groups"].values():
        merged = [f"{g['merged_sequential'][k]['mean']:.4g} / {g['merged'][k]['mean']:.4g}" for k in keys]
        lines.append(
            f"| merged ({g['merged']['em']['n'] if 'em' in g['merged'] else '-'} merges) | {g['variant']} | "
            + " | ".join(merged)
            + " |"
        )
        ens = [f"{g['ensemble_sequential'][k]:.4g} / {g['ensemble'][k]['mean']:.4g}" for k in keys]
        lines.append(f"| ensemble of {len(g['members'])} | {g['variant']} | " + " | ".join(ens) + " |")
    lines += ["", "| check | value | target | holds |", "| --- | --- | --- | --- |"]
    for owner, checks in report.get("targets", {}).items():
        for name, c in checks.items():
            lines.append(f"| {owner.split('/')[-1]}: {name} | {c['value']} | {c['target']} | {c['holds']} |")
    for name, d in report.get("drafting", {}).items():
        best, ex = d["draft"]["best"], d["early_exit"]
        exit_line = (
            "no threshold within the loss"
            if ex["threshold"] is None
            else (
                f"threshold {ex['threshold']}: {ex['test']['exit']['hop_speedup']}x fewer hops, exact match "
                f"{ex['test']['full']['em']:.4f} -> {ex['test']['exit']['em']:.4f}"
            )
        )
        lines.append(
            f"\n{name}: best draft depth {best['draft_depth']} k {best['k']}: acceptance {best['acceptance']}, "
            f"{best['tokens_per_trip']} tokens per trip, {best['speedup']}x fewer hop-equivalents per token than "
            f"plain decoding through the whole route; early exit {exit_line}"
        )
    return "\n".join(lines)
