"""`layerswarm import-hf`: a Hugging Face decoder checkpoint as a layerswarm model directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .base import Subparsers, UsageError, add_command, folder, int_at_least


def register(sub: Subparsers) -> None:
    p = add_command(
        sub,
        "import-hf",
        run,
        help="import a Hugging Face Llama-layout checkpoint as a model directory",
        description="Convert a local Hugging Face decoder (config.json, model.safetensors or its shards, "
        "tokenizer.json) into a model directory: one safetensors file per block, the stem, the head and the "
        "tokenizer, all hashed in the manifest. model_type llama (TinyLlama, SmolLM, Llama without rope "
        "scaling), mistral (no sliding window shorter than the context) and qwen2 (q/k/v biases) import; "
        "weights are read with safetensors only (never unpickled) and become float32. Fine-tune it with "
        "`layerswarm train --data lm:... --init DIR` (LayerShuffle makes its blocks order-robust).",
    )
    p.add_argument("path", type=Path, help="the Hugging Face model directory (local; nothing is downloaded)")
    p.add_argument("--out", required=True, type=folder, help="model directory to write")
    p.add_argument(
        "--variant",
        choices=("baseline", "layershuffle", "layerdrop"),
        default="baseline",
        help="what the manifest says the blocks were trained for: a checkpoint trained in order is a baseline",
    )
    p.add_argument("--tokenizer", type=Path, help="a tokenizer.json to use when the checkpoint has none")
    p.add_argument("--context", type=int_at_least(8), help="the context kept (default: the checkpoint's, at most 4096)")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in OUT")


def run(args: argparse.Namespace) -> int:
    from layerswarm.training.lm.commands import import_hf
    from layerswarm.training.runs import check_out_writable

    if not args.path.is_dir():
        raise UsageError(f"{args.path}: not a directory (a local Hugging Face model directory)")
    check_out_writable(args.out, False, args.overwrite)
    manifest = import_hf(args.path, args.out, args.variant, args.tokenizer, args.context)
    cfg = manifest.config
    print(
        json.dumps(
            {
                "event": "imported",
                "out": str(args.out),
                "model_id": manifest.model_id,
                "family_id": manifest.family_id,
                "blocks": cfg.depth,
                "dim": cfg.dim,
                "vocab_size": cfg.vocab_size,
            }
        )
    )
    return 0
