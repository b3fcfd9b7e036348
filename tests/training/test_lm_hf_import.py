"""Bring your own checkpoint: a tiny random Llama (and Qwen2, Mistral) written by `transformers` imports
through `layerswarm import-hf`, and its blocks, loaded one by one from the model directory as twelve nodes
would, give transformers' own logits and greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layerswarm.cli import main
from layerswarm.models.checkpoint import load_block, load_stem_head, read_lm_manifest
from layerswarm.models.lm.generate import generate
from layerswarm.models.lm.hf_import import HFImportError, hf_lm_config
from layerswarm.training.lm.tokenizer import train_bpe

transformers = pytest.importorskip("transformers")

# Measured (fp32): max abs difference 0.0 for every layout below: the same operations in the same order.
LOGIT_TOL = 1e-5


def write_checkpoint(path: Path, model_type: str, tie: bool = False) -> object:
    cls = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[model_type]
    config_cls, model_cls = getattr(transformers, f"{cls}Config"), getattr(transformers, f"{cls}ForCausalLM")
    extra = {"sliding_window": None} if model_type == "mistral" else {}
    config = config_cls(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=tie, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = model_cls(config).eval()
    with torch.no_grad():
        for p in hf.parameters():  # larger than the init's 0.02: logits that differ clearly between tokens
            p.mul_(5.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path, safe_serialization=True)
    train_bpe(["some text to learn a few merges from", "12+34=46"], 300).save(str(path / "tokenizer.json"))
    return hf


def node_route(model_dir: Path) -> tuple[torch.nn.Module, list[torch.nn.Module], torch.nn.Module]:
    manifest = read_lm_manifest(model_dir)
    stem, head = load_stem_head(model_dir, manifest)
    return stem, [load_block(model_dir, i, manifest) for i in range(manifest.config.depth)], head


@pytest.mark.parametrize(
    ("model_type", "tie"), [("llama", False), ("llama", True), ("qwen2", False), ("mistral", False)]
)
def test_imported_blocks_match_transformers(tmp_path: Path, model_type: str, tie: bool) -> None:
    hf = write_checkpoint(tmp_path / "hf", model_type, tie)
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m")]) == 0
    stem, blocks, head = node_route(tmp_path / "m")
    tokens = torch.randint(3, 320, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(tokens).logits  # type: ignore[operator]
        x = stem(tokens)
        for block in blocks:
            x = block(x)
        ours = head(x)
        diff = (ours - theirs).abs().max().item()
        assert diff <= LOGIT_TOL, diff
        prompt = tokens[:1, :8]
        expected = hf.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)  # type: ignore[attr-defined]
        got = generate(stem, blocks, head, [prompt[0].tolist()], 32)  # greedy, cached, one node per block
    assert got[0] == expected[0, 8:].tolist()
    manifest = read_lm_manifest(tmp_path / "m")
    assert manifest.lineage.source == "huggingface" and manifest.lineage.root.startswith("hf-")  # type: ignore[union-attr]
    assert manifest.config.qkv_bias == (model_type == "qwen2") and manifest.config.tie_embeddings == tie


def test_pickles_and_unsupported_layouts_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(
        '{"model_type": "llama", "num_attention_heads": 4, "hidden_size": 64, '
        '"num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 8}'
    )
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"not unpickled")
    assert main(["import-hf", str(tmp_path / "bin"), "--out", str(tmp_path / "out")]) == 2
    assert "never unpickled" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    base = {
        "num_attention_heads": 4,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 10,
        "intermediate_size": 8,
    }
    for bad, reason in (
        ({"model_type": "gpt2"}, "model_type"),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope scaling"),
        ({"model_type": "llama", "attention_bias": True}, "biases"),
        ({"model_type": "mistral", "sliding_window": 16, "max_position_embeddings": 64}, "sliding_window"),
    ):
        with pytest.raises(HFImportError, match=reason):
            hf_lm_config({**base, **bad})
