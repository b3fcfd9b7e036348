"""`layerswarm train` and `eval` on text data (models/commands.py hands text data specs to these).

The same Trainer, recipe, model directory and evaluation as for images; what differs is only how data
becomes tensors: a tokenizer trained from the training texts (or the --init model's own) turns texts
into [CLS]-led, [PAD]-filled token ids, and the tokenizer is saved and hashed in the model directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from layerswarm.models.checkpoint import (
    TOKENIZER,
    Lineage,
    Manifest,
    load_model,
    read_manifest,
    save_model,
    verified_file,
)
from layerswarm.models.config import ViTConfig
from layerswarm.models.policy import MIN_BLOCKS, write_entry
from layerswarm.models.text.model import TextEncoder
from layerswarm.models.text.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

from ..evaluation.evaluate import EvalPlan, check_targets, evaluate_models, min_useful_depth
from ..recipe import TrainRecipe, recipe_from_args
from ..train import Trainer
from ..train_report import describe_epoch
from ..train_state import TRAIN_STATE
from .data import TextDataset, encode_corpus, load_corpus

log = logging.getLogger(__name__)


def model_tokenizer(model_dir: str | Path, manifest: Manifest | None = None) -> Tokenizer:
    """A text model's tokenizer, after checking its hash against the manifest."""
    manifest = manifest or read_manifest(model_dir)
    if not manifest.config.is_text:
        raise ValueError(f"{model_dir} is an image model; text data needs a text model")
    return load_tokenizer(verified_file(model_dir, manifest, TOKENIZER))


def text_train_main(args: argparse.Namespace) -> int:
    from ..runs import _quick_metrics, _report_run, chosen_size, pick_train_device

    started = time.perf_counter()
    size: dict[str, Any] | None = None  # from scratch only: a fine-tune keeps its parent's width and depth
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = load_corpus(args.data, seed=args.data_seed)
    if args.init:
        tok = model_tokenizer(args.init)
        parent, manifest = load_model(args.init)
        data = encode_corpus(corpus, tok, parent.cfg.max_tokens)
        model, lineage = _fine_tune_copy(parent, manifest, data, args.variant)
    else:
        tok = train_tokenizer(corpus.train_texts, vocab_size=args.vocab_size)
        data = encode_corpus(corpus, tok, args.max_tokens)
        budget_s = args.time_budget_s or TrainRecipe.time_budget_s  # text: no data-derived budget (not measured)
        size = chosen_size(args, len(data.train_y), image_size=None, time_budget_s=budget_s)  # auto: base for text
        torch.manual_seed(args.seed)
        cfg = ViTConfig(
            kind="text",
            vocab_size=tok.get_vocab_size(),
            max_tokens=args.max_tokens,
            num_classes=len(data.class_names),
            variant=args.variant,
            class_names=data.class_names,
            depth=size["depth"],
            dim=size["dim"],
            heads=size["heads"],
        )
        model, lineage = TextEncoder(cfg), Lineage(source="scratch")
    if getattr(args, "token_depth", None):
        model.token_depth_table = _init_depth_table(args, model.cfg.vocab_size)
    # No shuffle ramp unless asked: measured on images only (docs/own-data.md). No image flips and shifts
    # either: they would scramble word order.
    recipe = recipe_from_args(args, augment=False, shuffle_ramp=args.shuffle_ramp or 0.0)
    trainer = Trainer(model, data, recipe, pick_train_device(args.device), args.out / TRAIN_STATE)
    if args.resume:
        trainer.load_state()
    trainer.fit(on_epoch=lambda record: tqdm.write(describe_epoch(record, recipe.epochs), file=sys.stderr))
    _report_run(trainer, len(data.class_names))
    trained = trainer.model.eval()
    metrics = _quick_metrics(trained, data, 0)
    record = {**asdict(recipe), "init": args.init, "size": size}
    record.update(command=args.command_line, history=trainer.history)
    record["seconds"] = round(time.perf_counter() - started, 1)
    dataset = {**data.describe(), "data_seed": args.data_seed}
    save_tokenizer(tok, args.out)
    manifest = save_model(trained.cpu(), args.out, lineage, recipe=record, dataset=dataset, metrics=metrics)
    if recipe.token_depth:  # serve with the very tables it was trained with
        from layerswarm.models.text.depth import DEPTH_POLICY

        write_entry(args.out, DEPTH_POLICY, read_manifest(args.init).policy[DEPTH_POLICY])
    event = {"event": "trained", "out": str(args.out), "model_id": manifest.model_id}
    print(json.dumps({**event, "family_id": manifest.family_id, "variant": args.variant, **metrics}))
    return 0


def _init_depth_table(args: argparse.Namespace, vocab_size: int) -> torch.Tensor:
    """The --init model's per-token depth table named by --token-depth (a clear error without one)."""
    from layerswarm.models.text.depth import DEPTH_POLICY

    if not args.init:
        raise ValueError("--token-depth needs --init: the depth table comes from that model's policy")
    table = read_manifest(args.init).policy.get(DEPTH_POLICY, {}).get(args.token_depth)
    if not isinstance(table, list) or len(table) != vocab_size:
        raise ValueError(f"--init model has no {args.token_depth} token depths: run `layerswarm depth {args.init}`")
    return torch.tensor(table, dtype=torch.long)


def _fine_tune_copy(parent: Any, manifest: Manifest, data: TextDataset, variant: str) -> tuple[TextEncoder, Lineage]:
    cfg = parent.cfg.replace(variant=variant)
    if cfg.architecture() != parent.cfg.architecture():
        raise ValueError(f"cannot fine-tune a {parent.cfg.variant} model as {variant}: the block shapes differ")
    if cfg.class_names != data.class_names:
        raise ValueError(f"--init model's classes {list(cfg.class_names)} differ from the data's")
    model = TextEncoder(cfg)
    model.load_state_dict(parent.state_dict())
    return model, Lineage(root=manifest.lineage.root, parent=manifest.model_id, source="model")


def load_text_data(spec: str, model_dir: str | Path) -> TextDataset:
    """A text data spec encoded with a model's own tokenizer (what eval and serving clients use)."""
    manifest = read_manifest(model_dir)
    corpus = load_corpus(spec, seed=int(manifest.dataset.get("data_seed", 0)))
    return encode_corpus(corpus, model_tokenizer(model_dir, manifest), manifest.config.max_tokens)


def text_eval_main(args: argparse.Namespace, spec: str) -> int:
    from ..evaluation.runs import render_table

    data = load_text_data(spec, args.model_dirs[0])
    plan = EvalPlan(orders=args.orders, merges=args.merges, seed=args.seed)
    report = evaluate_models([str(d) for d in args.model_dirs], data, plan)
    report["targets"] = check_targets(report, chance=1.0 / len(data.class_names))
    if not args.no_policy:
        for model_dir in args.model_dirs:
            row = report["models"][str(model_dir).rstrip("/").rsplit("/", 1)[-1]]
            group = report["groups"].get(f"{row['family_id']}/{row['variant']}")
            order = "arbitrary" if row["variant"].startswith("layershuffle") else "sequential"
            depth_policy = min_useful_depth((group or row)["pruned"], order, args.min_depth_margin)
            write_entry(model_dir, MIN_BLOCKS, {**depth_policy, "measured_on": "family" if group else "model"})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(render_table(report))
    return 0


def text_depth_main(args: argparse.Namespace) -> int:
    """Depth tables from each model's own training split, written to its policy, then evaluated on
    its test split."""
    from layerswarm.models.text.depth import DEPTH_POLICY

    from .depth import depth_policy, mi_depths
    from .depth_eval import evaluate_depths
    from .reconstruction import reconstruction_depths

    report: dict[str, Any] = {}
    for model_dir in args.model_dirs:
        manifest = read_manifest(model_dir)
        spec = manifest.dataset.get("spec")
        if not manifest.config.is_text or not spec:
            raise SystemExit(f"layerswarm depth: {model_dir} is not a text model with a recorded dataset")
        data = load_text_data(str(spec), model_dir)
        model, _ = load_model(model_dir)
        cfg = model.cfg
        assert isinstance(data.train_x, torch.Tensor) and isinstance(data.test_x, torch.Tensor)
        word_losses: dict[str, list[float]] = {}
        if args.existing:
            policy = manifest.policy.get(DEPTH_POLICY)
            if not isinstance(policy, dict):
                raise ValueError(f"{model_dir} has no token depth tables to evaluate: run without --existing")
        else:
            mi = mi_depths(data.train_x, data.train_y, cfg.vocab_size, cfg.num_classes, bins=cfg.depth)
            recon, word_losses = reconstruction_depths(
                model, data.train_x, max_sentences=args.sentences, steps=args.mlm_steps
            )
            policy = depth_policy(mi, recon, cfg.depth)
            if not args.no_write:
                write_entry(model_dir, DEPTH_POLICY, policy)
        name = str(model_dir).rstrip("/").rsplit("/", 1)[-1]
        report[name] = {
            "mean_table_depth": policy["mean_over_vocab"],
            "reconstruction_loss_per_layer": word_losses,
            "test_sentences": len(data.test_y[: args.limit]),
            "results": evaluate_depths(
                model, data.test_x[: args.limit], data.test_y[: args.limit], policy, orders=args.orders
            ),
        }
        print(json.dumps({name: report[name]["results"]}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
