"""`layerswarm train`, `eval` and `depth` on text, from typed jobs (the CLI reads the flags and sends
text data specs and text models here).

The same Trainer, recipe, model directory and evaluation as for images; what differs is only how data
becomes tensors: a tokenizer trained from the training texts (or the --init model's own) turns texts
into [CLS]-led, [PAD]-filled token ids, and the tokenizer is saved and hashed in the model directory.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from typing_extensions import TypedDict

from layerswarm.models.checkpoint import Lineage, Manifest, load_model, read_manifest, save_model
from layerswarm.models.config import ViTConfig
from layerswarm.models.policy import MIN_BLOCKS, write_entry
from layerswarm.models.text.depth import DEPTH_POLICY
from layerswarm.models.text.model import TextEncoder
from layerswarm.models.text.tokenizer import save_tokenizer, train_tokenizer

from ..evaluation.adaptive import calibrate_model
from ..evaluation.evaluate import EvalPlan, check_targets, evaluate_models, min_useful_depth
from ..evaluation.report import EvalReport
from ..evaluation.runs import EvalJob, model_name
from ..recipe import TrainRecipe
from ..runs import Trained, TrainJob, check_out_writable, chosen_size, pick_train_device, quick_metrics, report_run
from ..size import SizeChoice
from ..train import Trainer
from ..train_report import describe_epoch
from ..train_state import TRAIN_STATE
from .data import TextDataset, encode_corpus, load_corpus, load_text_data, model_tokenizer
from .depth import depth_policy, mi_depths
from .depth_eval import evaluate_depths
from .reconstruction import reconstruction_depths


def train_text_model(job: TrainJob) -> Trained:
    started = time.perf_counter()
    check_out_writable(job.out, job.resume, job.overwrite)
    size: SizeChoice | None = None  # from scratch only: a fine-tune keeps its parent's width and depth
    recipe = job.recipe
    if recipe.threads:
        torch.set_num_threads(recipe.threads)
    corpus = load_corpus(job.data, seed=job.data_seed)
    if job.init:
        tok = model_tokenizer(job.init)
        parent, manifest = load_model(job.init)
        data = encode_corpus(corpus, tok, parent.cfg.max_tokens)
        model, lineage = _fine_tune_copy(parent, manifest, data, recipe.variant)
    else:
        tok = train_tokenizer(corpus.train_texts, vocab_size=job.vocab_size)
        data = encode_corpus(corpus, tok, job.max_tokens)
        budget_s = job.time_budget_s or TrainRecipe.time_budget_s  # text: no data-derived budget (not measured)
        size = chosen_size(job, len(data.train_y), image_size=None, time_budget_s=budget_s)  # auto: base for text
        torch.manual_seed(recipe.seed)
        cfg = ViTConfig(
            kind="text",
            vocab_size=tok.get_vocab_size(),
            max_tokens=job.max_tokens,
            num_classes=len(data.class_names),
            variant=recipe.variant,
            class_names=data.class_names,
            depth=size["depth"],
            dim=size["dim"],
            heads=size["heads"],
        )
        model, lineage = TextEncoder(cfg), Lineage(source="scratch")
    if recipe.token_depth:
        model.token_depth_table = _init_depth_table(job.init, recipe.token_depth, model.cfg.vocab_size)
    trainer = Trainer(model, data, recipe, pick_train_device(job.device), job.out / TRAIN_STATE)
    if job.resume:
        trainer.load_state()
    trainer.fit(on_epoch=lambda record: tqdm.write(describe_epoch(record, recipe.epochs), file=sys.stderr))
    report_run(trainer, len(data.class_names))
    trained = trainer.model.eval()
    metrics = quick_metrics(trained, data, 0)
    record = {**asdict(recipe), "init": job.init, "size": size}
    record.update(command=job.command_line, history=trainer.history)
    record["seconds"] = round(time.perf_counter() - started, 1)
    dataset = {**data.describe(), "data_seed": job.data_seed}
    save_tokenizer(tok, job.out)
    manifest = save_model(trained.cpu(), job.out, lineage, recipe=record, dataset=dataset, metrics=dict(metrics))
    if recipe.token_depth and job.init:  # serve with the very tables it was trained with
        write_entry(job.out, DEPTH_POLICY, read_manifest(job.init).policy[DEPTH_POLICY])
    return Trained(job.out, manifest, metrics)


def _init_depth_table(init: str | None, estimate: str, vocab_size: int) -> torch.Tensor:
    """The --init model's per-token depth table named by --token-depth (a clear error without one)."""
    if not init:
        raise ValueError("--token-depth needs --init: the depth table comes from that model's policy")
    table = read_manifest(init).policy.get(DEPTH_POLICY, {}).get(estimate)
    if not isinstance(table, list) or len(table) != vocab_size:
        raise ValueError(f"--init model has no {estimate} token depths: run `layerswarm depth {init}`")
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


def evaluate_text_models(job: EvalJob, spec: str) -> EvalReport:
    """The paper's experiments on text models (tokenised with the first model's tokenizer), and each
    model's minimum useful depth written into its policy unless the job says not to; with calibration,
    each model's adaptive-compute policy as for images."""
    data = load_text_data(spec, job.model_dirs[0])
    report: EvalReport = {"dataset": data.describe(), "models": {}, "groups": {}}
    if job.experiments:
        plan = EvalPlan(orders=job.orders, merges=job.merges, seed=job.seed)
        report = evaluate_models([str(d) for d in job.model_dirs], data, plan)
        report["targets"] = check_targets(report, chance=1.0 / len(data.class_names))
        if job.write_policy:
            write_text_min_depths(job, report)
    if job.calibrate:
        write = job.write_calibration and not job.test_noise  # text has no noisy split: never one to write from
        report["calibration"] = {
            model_name(d): calibrate_model(d, data, job.calibration, write=write) for d in job.model_dirs
        }
    return report


def write_text_min_depths(job: EvalJob, report: EvalReport) -> None:
    """Each model's minimum useful depth, from its family's pruning curve where it has one."""
    for model_dir in job.model_dirs:
        row = report["models"][model_name(model_dir)]
        group = report["groups"].get(f"{row['family_id']}/{row['variant']}")
        order = "arbitrary" if row["variant"].startswith("layershuffle") else "sequential"
        depth = min_useful_depth((group or row)["pruned"], order, job.min_depth_margin)
        write_entry(model_dir, MIN_BLOCKS, {**depth, "measured_on": "family" if group else "model"})


class NotATextModel(ValueError):
    """`layerswarm depth` was given a model directory that is not a text model with a recorded dataset."""


@dataclass(frozen=True)
class DepthJob:
    """One `layerswarm depth`: per-token depth tables for text models, estimated and evaluated."""

    model_dirs: tuple[Path, ...]
    orders: int = 5  # random block orders for the arbitrary-order figure
    sentences: int = 1000  # sentences for the reconstruction estimate
    mlm_steps: int = 400  # fine-tuning steps of the anytime masked LM behind it
    write: bool = True  # write the tables into each model's policy
    limit: int | None = None  # evaluate on the first N test sentences only (None: all)
    existing: bool = False  # evaluate the tables already in each model's policy instead of estimating


class DepthReport(TypedDict):
    """One model's `layerswarm depth` figures."""

    mean_table_depth: dict[str, float]  # per estimate, over the vocabulary
    reconstruction_loss_per_layer: dict[str, list[float]]
    test_sentences: int
    results: dict[str, Any]  # per estimate and order: accuracy, depth, tokens computed (depth_eval.py)


def estimate_depths(
    job: DepthJob, on_model: Callable[[str, DepthReport], None] | None = None
) -> dict[str, DepthReport]:
    """Depth tables from each model's own training split, written to its policy, then evaluated on
    its test split; `on_model` hears of each model as it is done."""
    report: dict[str, DepthReport] = {}
    for model_dir in job.model_dirs:
        manifest = read_manifest(model_dir)
        spec = manifest.dataset.get("spec")
        if not manifest.config.is_text or not spec:
            raise NotATextModel(f"{model_dir} is not a text model with a recorded dataset")
        data = load_text_data(str(spec), model_dir)
        model, _ = load_model(model_dir)
        cfg = model.cfg
        assert isinstance(data.train_x, torch.Tensor) and isinstance(data.test_x, torch.Tensor)
        word_losses: dict[str, list[float]] = {}
        if job.existing:
            policy = manifest.policy.get(DEPTH_POLICY)
            if not isinstance(policy, dict):
                raise ValueError(f"{model_dir} has no token depth tables to evaluate: run without --existing")
        else:
            mi = mi_depths(data.train_x, data.train_y, cfg.vocab_size, cfg.num_classes, bins=cfg.depth)
            recon, word_losses = reconstruction_depths(
                model, data.train_x, max_sentences=job.sentences, steps=job.mlm_steps
            )
            policy = depth_policy(mi, recon, cfg.depth)
            if job.write:
                write_entry(model_dir, DEPTH_POLICY, policy)
        name = model_name(model_dir)
        report[name] = {
            "mean_table_depth": policy["mean_over_vocab"],
            "reconstruction_loss_per_layer": word_losses,
            "test_sentences": len(data.test_y[: job.limit]),
            "results": evaluate_depths(
                model, data.test_x[: job.limit], data.test_y[: job.limit], policy, orders=job.orders
            ),
        }
        if on_model:
            on_model(name, report[name])
    return report
