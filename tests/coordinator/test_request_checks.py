"""The coordinator's own checks of a request, before any node sees it (pure: no swarm needed).

A request these let through would make every node refuse the hop, and each refusal counts against the
node: so each case here is one a client could otherwise use to get healthy nodes ejected."""

from __future__ import annotations

import pytest
import torch

from layerswarm.coordinator import ClassifyOptions
from layerswarm.coordinator.routing.request import InvalidRequest, check_images, check_options, check_stem_output
from layerswarm.models.config import ViTConfig

CONFIG = ViTConfig(depth=3, dim=32, heads=2)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e30, 40000.0])
def test_stem_output_no_node_can_take_is_the_callers_error(value: float) -> None:
    x = torch.zeros(1, 5, 8)
    x[0, 3, 2] = value
    with pytest.raises(InvalidRequest, match="no node can take"):
        check_stem_output(x, torch.float16)


def test_stem_output_within_the_wire_limit_passes() -> None:
    check_stem_output(torch.full((1, 5, 8), 30000.0), torch.float16)  # under half of fp16's 65504
    check_stem_output(torch.full((1, 5, 8), 1e30), torch.float32)  # fp32's limit is far higher


@pytest.mark.parametrize("value", [float("nan"), 1.5, -0.25, 255.0])
def test_images_outside_unit_range_are_refused(value: float) -> None:
    images = torch.full((1, 3, 8, 8), 0.5)
    images[0, 1, 2, 3] = value
    with pytest.raises(InvalidRequest):
        check_images(images, CONFIG)
    check_images(torch.rand(1, 3, 8, 8), CONFIG)


@pytest.mark.parametrize(("low", "high"), [(4, None), (3, 2)])
def test_block_counts_the_model_cannot_serve_are_refused(low: int, high: int | None) -> None:
    with pytest.raises(InvalidRequest, match="min_blocks"):
        check_options(ClassifyOptions(min_blocks=low, max_blocks=high), CONFIG)
    check_options(ClassifyOptions(min_blocks=3, max_blocks=3), CONFIG)
