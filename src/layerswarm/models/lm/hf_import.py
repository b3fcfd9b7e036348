"""Import a local Hugging Face decoder checkpoint in the Llama layout (config.json + safetensors).

Works for model_type "llama" (Llama 1-3 without rope scaling, TinyLlama, SmolLM, ...), "mistral" (when
its sliding window covers the context, or none is set) and "qwen2" (biases on q, k, v); tied or untied
embeddings; sharded checkpoints (model.safetensors.index.json). Weights are read with safetensors only,
never a pickle: a directory with only pytorch_model.bin is refused. Parameter names are HF's own (the
model code keeps them), so the conversion only strips "model." and splits the layers into blocks.
Weights become float32. Refused with a reason: rope scaling, biases on o_proj or the MLP, activations
other than SiLU, q/k norms (Qwen3, Gemma), and a sliding window shorter than the context.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..checkpoint import sha256_file
from .config import LMConfig
from .model import DecoderLM

MODEL_TYPES = ("llama", "mistral", "qwen2")
MAX_CONTEXT = 4096  # the context an import keeps at most (max_position_embeddings may be far larger)


class HFImportError(ValueError):
    """A checkpoint this importer cannot take (the message says which part and why)."""


def hf_lm_config(raw: dict[str, Any], variant: str = "layershuffle", max_seq_len: int | None = None) -> LMConfig:
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise HFImportError(f"model_type {model_type!r}: only {', '.join(MODEL_TYPES)} (the Llama layout) import")
    if raw.get("hidden_act", "silu") != "silu":
        raise HFImportError(f"hidden_act {raw['hidden_act']!r}: only SiLU-gated MLPs import")
    rope = raw.get("rope_parameters") or {}  # transformers 5; older configs: rope_theta and rope_scaling
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        raise HFImportError(f"rope scaling {scaling!r}: scaled rotary positions are not supported")
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if raw.get("mlp_bias") or (model_type == "llama" and raw.get("attention_bias")):
        raise HFImportError("biases on the attention output or the MLP are not supported (Qwen2's q/k/v biases are)")
    context = int(max_seq_len or min(int(raw.get("max_position_embeddings", 2048)), MAX_CONTEXT))
    window = raw.get("sliding_window") if raw.get("use_sliding_window", model_type == "mistral") else None  # qwen2: off
    if window is not None and int(window) < context:
        raise HFImportError(
            f"sliding_window {window} is shorter than the context {context}: full attention would differ"
        )
    heads = int(raw["num_attention_heads"])
    dim = int(raw["hidden_size"])
    head_dim = int(raw.get("head_dim") or dim // heads)
    bos, eos = raw.get("bos_token_id"), raw.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    return LMConfig(
        vocab_size=int(raw["vocab_size"]),
        dim=dim,
        depth=int(raw["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=0 if head_dim * heads == dim else head_dim,
        hidden_dim=int(raw["intermediate_size"]),
        max_seq_len=context,
        rope_theta=theta,
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        variant=variant,
        bos_id=-1 if bos is None else int(bos),
        eos_id=-1 if eos is None else int(eos),
        pad_id=int(raw.get("pad_token_id") or 0),
    )


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files (one, or the shards an index names)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise HFImportError(
            f"{path}: only pickled weights (*.bin): convert them to safetensors first (never unpickled here)"
        )
    raise HFImportError(f"{path}: no model.safetensors (or model.safetensors.index.json)")


def read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[key] = fh.get_tensor(key).float()
    return tensors


def convert(hf: dict[str, torch.Tensor], cfg: LMConfig) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM keys -> DecoderLM keys (stem.embed_tokens, blocks.i.*, head.norm, head.lm_head)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf.items():
        name = key.removeprefix("model.")
        if name.startswith("layers."):
            out["blocks." + name.removeprefix("layers.")] = value
        elif name == "embed_tokens.weight":
            out["stem.embed_tokens.weight"] = value
        elif name == "norm.weight":
            out["head.norm.weight"] = value
        elif name == "lm_head.weight":
            if not cfg.tie_embeddings:
                out["head.lm_head.weight"] = value
        elif not name.endswith("rotary_emb.inv_freq"):  # a buffer old checkpoints saved; recomputed here
            out[key] = value  # reported as unexpected below
    return out


def import_hf_lm(path: Path, variant: str = "layershuffle", max_seq_len: int | None = None) -> tuple[DecoderLM, str]:
    """The checkpoint as a DecoderLM, and the sha256-derived lineage root of its weights."""
    config = path / "config.json"
    if not config.is_file():
        raise HFImportError(f"{path}: no config.json (expected a Hugging Face model directory)")
    cfg = hf_lm_config(json.loads(config.read_text()), variant, max_seq_len)
    files = weight_files(path)
    model = DecoderLM(cfg)
    missing, unexpected = model.load_state_dict(convert(read_weights(files), cfg), strict=False)
    if missing or unexpected:
        raise HFImportError(
            f"{path}: weights do not fit the config: missing {sorted(missing)[:6]}, unexpected {sorted(unexpected)[:6]}"
        )
    digest = hashlib.sha256("".join(sha256_file(f) for f in files).encode()).hexdigest()
    return model.eval(), "hf-" + digest[:24]
