"""`layerswarm train`: train one model and write a model directory."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from layerswarm.models.config import STEMS, VARIANTS  # torch-free: building the parser stays fast
from layerswarm.training.recipe import (
    BUDGET_FEW_IMAGES,
    BUDGET_FEW_S,
    BUDGET_MANY_IMAGES,
    BUDGET_MANY_S,
    FROM_SCRATCH_SHUFFLE_RAMP,
)
from layerswarm.training.recipe import TrainRecipe as R  # every training default, stated once
from layerswarm.training.size import AUTO, SIZE_CHOICES, SIZES, auto_rule

if TYPE_CHECKING:  # torch: imported when a model is trained, not when the parser is built
    from layerswarm.training.runs import TrainJob

from . import lm
from .base import (
    Subparsers,
    add_command,
    folder,
    int_at_least,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability_below_one,
    share_of_schedule,
)

SIZE_HELP = (
    "width and depth of a model trained from scratch (--dim/--depth/--heads override it): "
    + ", ".join(s.describe() for s in SIZES)
    + f"; auto: {auto_rule()}"
)
DATA_HELP = (
    "shapes[:N_TRAIN[:N_TEST]] | shapes1[...] | digits | imagefolder:PATH | words[...] | csv:PATH | jsonl:PATH; "
    "a language model: lm:SOURCE[+SOURCE...] with sources tasks[:N_TRAIN[:N_TEST]], pydoc, txt:PATH, jsonl:PATH"
)


def data_spec(text: str) -> str:
    """argparse type: a data spec (DATA_HELP), image, text or language model, checked before any work starts."""
    if text.startswith("lm:"):  # a language model (layerswarm.training.lm)
        from layerswarm.training.lm.data import parse_spec

        try:
            parse_spec(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    # only when a data spec is given: that command needs torch
    from layerswarm.training.data.datasets import check_spec
    from layerswarm.training.text.data import check_text_spec, is_text_spec

    try:
        return check_text_spec(text) if is_text_spec(text) else check_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "train",
        run,
        help="train one model (LayerShuffle and its variants, baselines)",
        description="Train one model and write a model directory (manifest + safetensors per stem, block and head).",
    )
    p.add_argument("--data", required=True, type=data_spec, help=DATA_HELP)
    p.add_argument("--variant", choices=VARIANTS, default=R.variant, help="training approach")
    p.add_argument("--out", required=True, type=folder, help="model directory to write")
    p.add_argument(
        "--init",
        help="start from a model directory (fine-tune: same family) or hf:PATH (a local Hugging Face ViT with "
        "config.json + model.safetensors); none: from scratch",
    )
    p.add_argument(
        "--epochs", type=positive_int, default=R.epochs, help="passes over the training data at most (see --patience)"
    )
    p.add_argument(
        "--time-budget",
        dest="time_budget_s",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="seconds of training at most; the learning rate anneals to this budget or the last epoch, whichever "
        f"comes first. Default for images from scratch: {BUDGET_FEW_S:.0f} s up to {BUDGET_FEW_IMAGES:,} training "
        f"images, {BUDGET_MANY_S:.0f} s from {BUDGET_MANY_IMAGES:,} (between them along the log of the count: more "
        f"data needs more steps); {R.time_budget_s:.0f} s for a fine-tune (--init) and for text",
    )
    p.add_argument(
        "--patience",
        type=non_negative_int,
        default=R.patience,
        help="stop after this many epochs without a lower validation loss, counted once the warm-up is over, "
        "keeping the best (0: never stop early)",
    )
    p.add_argument(
        "--label-smoothing",
        type=probability_below_one,
        default=R.label_smoothing,
        help="images: label smoothing of the loss",
    )
    p.add_argument(
        "--shuffle-ramp",
        type=share_of_schedule,
        default=None,
        metavar="SHARE",
        help="LayerShuffle from scratch: over this share of the step schedule the chance that a batch runs its "
        "blocks in a random order rises from 0 to 1 (in order before), then every batch is shuffled; the model "
        "kept is chosen after it (0: shuffled from the first step). Default "
        f"{FROM_SCRATCH_SHUFFLE_RAMP:g} from scratch, 0 for a fine-tune (--init). On `compare` (docs/own-data.md) "
        "0.67 got past the plateau at 4,000 images in seeds where 0 (plain LayerShuffle) stayed stuck; on the "
        "other generated tasks it was as good or better",
    )
    p.add_argument(
        "--drop-path",
        type=probability_below_one,
        default=R.drop_path,
        help="stochastic depth: the probability that a training sample skips a block's attention or MLP "
        "branch (0: off; inference never drops)",
    )
    p.add_argument(
        "--mixup",
        type=non_negative_float,
        default=R.mixup,
        metavar="ALPHA",
        help="images: mixup, each training batch blended with a shuffled copy of itself by a weight lam drawn "
        "from Beta(ALPHA, ALPHA), the loss weighing the two images' labels by lam and 1 - lam (0: off; validation "
        "and test never mix; family members inherit it). Off by default: at 0.2 on the generated own-data tasks "
        "it cost 3.5-6.6 points of test accuracy with the default early stopping, whose patience it can end "
        "early (its validation loss swings while the rate is high), and did not win without it (docs/own-data.md, "
        '"Mixup, measured and left off")',
    )
    p.add_argument(
        "--stem",
        choices=STEMS,
        default=R.stem,
        help="how images become tokens (from scratch only): conv (a few 3x3 stride-2 convolutions; a small ViT "
        "learns far more from little data), patch (one strided convolution, the classic ViT stem) or shallow (one "
        "3x3 convolution, then a strided one: the blocks, not the stem, find and relate the objects, so a "
        "conventionally trained --variant baseline falls much further in arbitrary order: it collapsed on "
        "counting, as in the paper, and kept a third on relations; it costs accuracy: 5 points on relations, "
        "14 on counting; docs/own-data.md)",
    )
    p.add_argument(
        "--seed", type=non_negative_int, default=R.seed, help="training seed (order of batches, block orders, init)"
    )
    p.add_argument(
        "--split-seed",
        type=non_negative_int,
        default=R.split_seed,
        help="seed of the validation split (default: --seed); `layerswarm family` passes the base's, so no "
        "member validates on images its base trained on",
    )
    p.add_argument(
        "--bootstrap",
        action="store_true",
        help="train on a bootstrap resample of the training split (seeded by --seed); `layerswarm family "
        "--bootstrap` gives each member its own",
    )
    p.add_argument(
        "--data-seed", type=non_negative_int, default=0, help="seed of generated data (keep it equal across a family)"
    )
    p.add_argument("--batch-size", type=positive_int, default=R.batch_size, help="examples per step")
    p.add_argument("--lr", type=positive_float, default=R.lr, help="Adam learning rate, cosine-decayed after warm-up")
    p.add_argument("--warmup-steps", type=non_negative_int, default=R.warmup_steps, help="linear warm-up steps")
    p.add_argument(
        "--weight-decay",
        type=non_negative_float,
        default=R.weight_decay,
        help="decoupled weight decay (AdamW) on the weight matrices; 0: plain Adam",
    )
    p.add_argument("--no-augment", action="store_true", help="turn off augmentation (small shifts, and flips if asked)")
    p.add_argument(
        "--hflip",
        action="store_true",
        help="also mirror images left-right in augmentation (off by default: it changes the label of digits, text "
        "and left/right relations)",
    )
    p.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="skip the reference: by default a small CNN is trained on the same split for the same time and the "
        "ViT's validation accuracy is reported against it (and against chance), with a warning when far behind",
    )
    p.add_argument(
        "--reference-seconds",
        type=non_negative_float,
        default=0.0,
        help="the reference CNN's training budget in seconds (0: the ViT's own training time)",
    )
    p.add_argument("--size", choices=SIZE_CHOICES, default=AUTO, help=SIZE_HELP)
    p.add_argument("--depth", type=positive_int, help="blocks (from scratch only; none: from --size)")
    p.add_argument("--dim", type=positive_int, help="embedding size D (from scratch only; none: from --size)")
    p.add_argument(
        "--heads", type=positive_int, help="attention heads (from scratch only; none: from --size, 16 channels each)"
    )
    p.add_argument(
        "--patch-size",
        type=positive_int,
        help="patch side P (from scratch only; none: from the image size, the largest of 16, 8, 4, 2 leaving at "
        "least 7 patches a side, 4 for a conv or shallow stem: 32 x 32 -> 8 (conv, shallow), 4 (patch))",
    )
    p.add_argument(
        "--max-tokens", type=int_at_least(2), default=32, help="text: longest sequence, [CLS] included (from scratch)"
    )
    p.add_argument("--vocab-size", type=int_at_least(8), default=8000, help="text: tokenizer vocabulary (from scratch)")
    add_image_args(p)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--threads", type=non_negative_int, default=R.threads, help="torch CPU threads (0: torch's default)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/.train_state if present")
    p.add_argument(
        "--overwrite", action="store_true", help="replace the model or unfinished run in OUT (refused without it)"
    )
    p.add_argument(
        "--token-depth",
        choices=("mi", "reconstruction"),
        help="text, with --init: train with per-token depth from the --init model's table (`layerswarm depth`): "
        "each token freezes after its depth, as the swarm serves it (the paper trains with its depths)",
    )
    p.add_argument(
        "--exit-loss",
        type=non_negative_float,
        default=R.exit_loss,
        help="weight of an early-exit loss: the shared head's cross-entropy after every truncation depth of "
        "the batch's random order (LayerSkip-style; 0: off)",
    )
    lm.add_train_args(p)


def add_image_args(p: argparse.ArgumentParser, train: bool = True) -> None:
    """Image size (train only) and how image folders are decoded (train, family, eval)."""
    if train:
        p.add_argument(
            "--image-size",
            type=positive_int,
            help="image side S the model takes (from scratch; none: 32); with --init, the model's own, "
            "which this must match if given",
        )
    p.add_argument(
        "--workers", type=non_negative_int, default=2, help="processes decoding image folders (0: the main process)"
    )
    p.add_argument(
        "--data-memory-mb",
        type=non_negative_int,
        default=2048,
        help="image folders larger than this once decoded stream from disk",
    )


def run(args: argparse.Namespace) -> int:
    if args.data.startswith("lm:"):
        return lm.train_command(args)
    from layerswarm.training.runs import train_image_model
    from layerswarm.training.text.data import is_text_spec
    from layerswarm.training.text.runs import train_text_model

    text = is_text_spec(args.data)
    trained = train_text_model(train_job(args, text)) if text else train_image_model(train_job(args, text))
    event = {"event": "trained", "out": str(trained.out), "model_id": trained.manifest.model_id}
    print(json.dumps({**event, "family_id": trained.manifest.family_id, "variant": args.variant, **trained.metrics}))
    return 0


def train_job(args: argparse.Namespace, text: bool) -> TrainJob:
    """The job a `layerswarm train` command line asks for. Text gets no image augmentation (flips and
    shifts would scramble word order) and no shuffle ramp unless asked (measured on images only,
    docs/own-data.md)."""
    from layerswarm.training.runs import TrainJob

    if text:
        recipe = recipe_from_args(args, augment=False, shuffle_ramp=args.shuffle_ramp or 0.0)
    else:
        recipe = recipe_from_args(args, augment=not args.no_augment, hflip=args.hflip)
    return TrainJob(
        data=args.data,
        out=args.out,
        recipe=recipe,
        init=args.init,
        time_budget_s=args.time_budget_s,
        data_seed=args.data_seed,
        size=args.size,
        dim=args.dim,
        depth=args.depth,
        heads=args.heads,
        stem=args.stem,
        patch_size=args.patch_size,
        image_size=args.image_size,
        max_tokens=args.max_tokens,
        vocab_size=args.vocab_size,
        workers=args.workers,
        data_memory_mb=args.data_memory_mb,
        reference=args.reference,
        reference_seconds=args.reference_seconds,
        device=args.device,
        resume=args.resume,
        overwrite=args.overwrite,
        command_line=args.command_line,
    )


def recipe_from_args(args: argparse.Namespace, **overrides: Any) -> R:
    """The recipe a `layerswarm train` command line asks for (`overrides`: what the data kind decides, in
    place of the command line's; a --time-budget not given is the recipe's default, which an image run
    from scratch then replaces with the one its data needs)."""
    fields = (
        *("variant", "epochs", "batch_size", "lr", "weight_decay", "warmup_steps", "seed", "split_seed"),
        *("threads", "exit_loss", "bootstrap"),
        *("time_budget_s", "patience", "label_smoothing", "drop_path", "mixup"),
    )
    ramp = getattr(args, "shuffle_ramp", None)
    if ramp is None:  # not asked: an image model from scratch ramps, a fine-tune's base has learnt already
        ramp = FROM_SCRATCH_SHUFFLE_RAMP if getattr(args, "init", None) is None else 0.0
    asked = {name: getattr(args, name) for name in fields}
    if asked["time_budget_s"] is None:
        asked["time_budget_s"] = R.time_budget_s
    overrides = {"shuffle_ramp": ramp, **overrides}
    if getattr(args, "token_depth", None):
        overrides = {"token_depth": args.token_depth, **overrides}
    return R(**{**asked, **overrides})
