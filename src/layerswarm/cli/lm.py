"""The language-model side of `train`, `family` and `eval`: selected by an lm: data spec (train) or a
decoder's model directory (family, eval), turned here from flags into the typed requests of
layerswarm.training.lm.commands. Not a command of its own: the command modules call in.

`train` shares its flags with the classifiers; where a shared flag's classifier default is not a good
language-model default (--lr, --weight-decay, --vocab-size) an LM run takes LMRecipe's / LMSize's unless
the flag is given. Flags that mean nothing to a decoder are refused by name rather than ignored.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from layerswarm.training.lm.recipe import LMRecipe as R  # torch-free: the parser shows its defaults

from .base import UsageError, int_at_least, positive_int, probability_below_one

CLASSIFIER_ONLY = (
    "--epochs",
    "--patience",
    "--label-smoothing",
    "--drop-path",
    "--mixup",
    "--stem",
    "--patch-size",
    "--image-size",
    "--hflip",
    "--no-augment",
    "--no-reference",
    "--reference-seconds",
    "--size",
    "--token-depth",
    "--max-tokens",
    "--bootstrap",
    "--split-seed",
    "--workers",
    "--data-memory-mb",
    "--batch-size",
    "--resume",
)


def add_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "language models (--data lm:...)",
        "A Llama-layout decoder (models/lm/): --dim, --depth, --heads, --vocab-size, --lr, --warmup-steps, "
        "--weight-decay, --seed, --time-budget, --shuffle-ramp, --exit-loss and --variant (baseline, layershuffle, "
        f"layerdrop) apply too; defaults for language models: --lr {R.lr}, --weight-decay {R.weight_decay}, "
        f"--time-budget {R.time_budget_s:.0f}, --vocab-size 512, 64 x 6 blocks x 4 heads. --init takes a decoder's "
        "model directory or hf:PATH (a Llama, Mistral or Qwen2 checkpoint in safetensors).",
    )
    g.add_argument("--kv-heads", type=positive_int, help="key/value heads (grouped-query attention; default heads / 2)")
    g.add_argument("--hidden-dim", type=positive_int, help="the gated MLP's width (default: Llama's 8/3 x dim)")
    g.add_argument("--context", type=int_at_least(8), default=128, help="the context in tokens (prompt + generated)")
    g.add_argument("--text-len", type=int_at_least(2), default=R.text_len, help="tokens per training row of real text")
    g.add_argument(
        "--text-share",
        type=probability_below_one,
        default=R.text_share,
        help="with tasks and text: the share of training steps drawn from the text",
    )
    g.add_argument("--batch-tokens", type=positive_int, default=R.batch_tokens, help="tokens per training step")
    g.add_argument(
        "--exit-dropout",
        type=probability_below_one,
        default=R.exit_dropout,
        help="exit-aware training (with --exit-loss, LayerSkip): per-sample layer dropout rising linearly from 0 at "
        "the route's first block to this rate at its last",
    )
    g.add_argument(
        "--budget-clock",
        choices=("wall", "cpu"),
        default=R.budget_clock,
        help="what --time-budget counts: wall-clock seconds, or this process's CPU seconds (what the run takes "
        "alone on its cores, however busy a shared machine is)",
    )
    g.add_argument("--val-every", type=positive_int, default=R.val_every, help="steps between validations")
    g.add_argument("--max-steps", type=positive_int, default=R.max_steps, help="optimizer steps at most")
    remember_flags(p)


def remember_flags(p: argparse.ArgumentParser) -> None:
    """Keep the command's option names, so `given` can tell an abbreviation from a flag of its own."""
    p.set_defaults(known_flags=frozenset(p._option_string_actions))  # argparse has no public list of them


def given(args: argparse.Namespace, flag: str) -> bool:
    """Whether the command line named `flag`, whole or abbreviated (argparse accepted the command line, so
    a prefix of `flag` that is no flag of its own can only be `flag`)."""
    known: frozenset[str] = getattr(args, "known_flags", frozenset())
    words = [w.split("=", 1)[0] for w in getattr(args, "argv", []) if w.startswith("--")]
    return any(w == flag or (flag.startswith(w) and w not in known) for w in words)


def train_command(args: argparse.Namespace) -> int:
    from layerswarm.training.lm.commands import LMSize, TrainLMRequest, train_lm
    from layerswarm.training.runs import check_out_writable

    for flag in CLASSIFIER_ONLY:
        if given(args, flag):
            raise UsageError(f"{flag} is for classifiers; a language model (--data lm:...) does not take it")
    if args.variant not in ("baseline", "layershuffle", "layerdrop"):
        raise UsageError(f"--variant {args.variant}: a language model is baseline, layershuffle or layerdrop")
    if args.device not in ("auto", "cpu"):
        raise UsageError(f"--device {args.device}: language models train on the CPU for now")
    if args.text_len > args.context and not args.init:
        raise UsageError(f"--text-len {args.text_len} does not fit --context {args.context}")
    check_out_writable(args.out, False, args.overwrite)
    heads = args.heads or LMSize.heads
    size = LMSize(
        dim=args.dim or LMSize.dim,
        depth=args.depth or LMSize.depth,
        heads=heads,
        kv_heads=args.kv_heads or max(1, heads // 2),
        hidden_dim=args.hidden_dim or 0,
        context=args.context,
        vocab_size=args.vocab_size if given(args, "--vocab-size") else LMSize.vocab_size,
    )
    recipe = R(
        variant=args.variant,
        time_budget_s=args.time_budget_s or R.time_budget_s,
        budget_clock=args.budget_clock,
        max_steps=args.max_steps,
        batch_tokens=args.batch_tokens,
        text_len=args.text_len,
        text_share=args.text_share,
        lr=args.lr if given(args, "--lr") else R.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay if given(args, "--weight-decay") else R.weight_decay,
        val_every=args.val_every,
        seed=args.seed,
        shuffle_ramp=args.shuffle_ramp or 0.0,
        exit_loss=args.exit_loss,
        exit_dropout=args.exit_dropout,
        threads=args.threads,
    )
    request = TrainLMRequest(args.data, args.out, recipe, size, args.init, args.data_seed, args.command_line)
    manifest = train_lm(request)
    event = {"event": "trained", "out": str(args.out), "model_id": manifest.model_id, "family_id": manifest.family_id}
    print(json.dumps({**event, "variant": manifest.variant, **manifest.metrics}))
    return 0


def is_lm_dir(path: Path) -> bool:
    from layerswarm.models.checkpoint import is_lm, read_any_manifest

    return is_lm(read_any_manifest(path))


def family_command(args: argparse.Namespace) -> int:
    from layerswarm.training.lm.commands import FamilyLMRequest, family_lm

    if args.variant not in ("baseline", "layershuffle", "layerdrop"):
        raise UsageError(f"--variant {args.variant}: a language model is baseline, layershuffle or layerdrop")
    for flag in ("--epochs", "--bootstrap", "--batch-size", "--workers", "--device"):
        if given(args, flag):
            raise UsageError(f"{flag} is for classifier families; a language-model family trains for --time-budget")
    request = FamilyLMRequest(
        base=args.base,
        out=args.out,
        members=args.members,
        prefix=args.prefix,
        variant=args.variant,
        time_budget_s=args.time_budget_s or FamilyLMRequest.time_budget_s,
        lr=args.lr,
        first_seed=args.first_seed,
        jobs=args.jobs,
        threads=args.threads,
        data=args.data,
        overwrite=args.overwrite,
        exit_loss=args.exit_loss,
        exit_dropout=args.exit_dropout,
    )
    from layerswarm.models.checkpoint import read_lm_manifest

    for out in family_lm(request):
        m = read_lm_manifest(out)
        print(
            f"{out.name}: {m.model_id} family {m.family_id} "
            + " ".join(f"{k} {v}" for k, v in sorted(m.metrics.items()))
        )
    return 0


def eval_command(args: argparse.Namespace) -> int:
    from layerswarm.training.lm.commands import EvalLMRequest, eval_lm, render_table
    from layerswarm.training.lm.evaluate import LMEvalPlan

    if args.calibrate or args.calibrate_only or args.plots or args.test_noise:
        raise UsageError(
            "--calibrate, --plots and --test-noise are for classifiers; a language model's eval always "
            "measures its drafts and early exits (issue 41)"
        )
    request = EvalLMRequest(
        model_dirs=list(args.model_dirs),
        data=args.data,
        plan=LMEvalPlan(orders=args.orders, merges=args.merges, seed=args.seed),
        json_out=args.json,
        write_policy=not args.no_policy,
        max_em_loss=args.margin / 100.0,
        min_depth_margin=args.min_depth_margin,
    )
    print(render_table(eval_lm(request)))
    return 0
