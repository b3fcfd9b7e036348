"""The split model: parts compose exactly, variants behave as the paper describes."""

from __future__ import annotations

import pytest
import torch

from layerswarm.models.config import VARIANTS, ViTConfig
from layerswarm.models.vit import ViT, run_blocks

from ..conftest import tiny_config


@pytest.mark.parametrize("variant", VARIANTS)
def test_block_by_block_equals_whole_model(variant: str) -> None:
    torch.manual_seed(0)
    model = ViT(tiny_config(variant)).eval()
    images = torch.rand(5, 3, 16, 16)
    with torch.no_grad():
        whole = model(images)
        x = model.stem(images)
        for position, block in enumerate(model.blocks):
            x = block(x, position)
        parts = model.head(x)
    assert torch.equal(whole, parts)


def test_any_order_changes_output_and_run_blocks_matches_order() -> None:
    torch.manual_seed(0)
    model = ViT(tiny_config()).eval()
    images = torch.rand(2, 3, 16, 16)
    with torch.no_grad():
        reordered = model(images, [2, 0, 1])
        manual = model.head(run_blocks([model.blocks[2], model.blocks[0], model.blocks[1]], model.stem(images)))
        assert torch.equal(reordered, manual)
        assert not torch.equal(reordered, model(images))


def test_block_shape_contract() -> None:
    cfg = tiny_config()
    model = ViT(cfg)
    x = torch.randn(3, cfg.num_tokens, cfg.dim)
    assert model.blocks[0](x, 1).shape == (3, cfg.num_tokens, cfg.dim)
    with pytest.raises(ValueError, match="position"):
        model.blocks[0](x, cfg.depth)


def test_position_variant_uses_the_position() -> None:
    torch.manual_seed(0)
    block = ViT(tiny_config("layershuffle-position")).blocks[0].eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        assert not torch.allclose(block(x, 0), block(x, 2))
    plain = ViT(tiny_config("layershuffle")).blocks[0].eval()
    with torch.no_grad():
        assert torch.equal(plain(x, 0), plain(x, 2))


def test_predict_variant_has_position_head() -> None:
    cfg = tiny_config("layershuffle-predict")
    block = ViT(cfg).blocks[0]
    assert block.position_logits(torch.randn(4, cfg.num_tokens, cfg.dim)).shape == (4, cfg.depth)
    with pytest.raises(RuntimeError):
        ViT(tiny_config("baseline")).blocks[0].position_logits(torch.randn(1, 5, 32))


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="variant"):
        ViTConfig(variant="magic")
    with pytest.raises(ValueError, match="multiple of patch_size"):
        ViTConfig(image_size=30, patch_size=8)
    with pytest.raises(ValueError, match="unknown config keys"):
        ViTConfig.from_dict({"dim": 8, "colour": 3})


def test_architecture_separates_position_blocks() -> None:
    assert tiny_config("baseline").architecture() == tiny_config("layershuffle").architecture()
    assert tiny_config("layershuffle").architecture() != tiny_config("layershuffle-position").architecture()


def test_drop_path_drops_whole_samples_in_training_and_nothing_at_inference() -> None:
    """Stochastic depth: per sample, both branches of a block, training only; eval output bit-exact."""
    torch.manual_seed(0)
    cfg = tiny_config()
    block = ViT(cfg).blocks[0]
    x = torch.randn(64, cfg.num_tokens, cfg.dim)
    with torch.no_grad():
        exact = block.eval()(x, 0)
        block.drop_path = 0.999
        assert torch.equal(block(x, 0), exact)  # eval: never dropped
        block.train()
        dropped = block(x, 0)
    # with both branches dropped a sample passes through unchanged; almost every sample is
    same = (dropped == x).flatten(1).all(dim=1)
    assert same.sum() >= 60
    block.drop_path = 0.0
    with torch.no_grad():
        torch.manual_seed(1)
        assert not (block(x, 0) == x).flatten(1).all(dim=1).any()  # rate 0: every sample transformed
