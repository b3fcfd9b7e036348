"""A small reference CNN, trained beside the ViT for the same wall-clock budget on the same split.

A from-scratch ViT on a few thousand images can learn far less than the data allows, and a validation
accuracy alone does not say so (0.35 on 8 classes looks like learning). Three convolutions trained
for the same time are a cheap, honest yardstick: when the ViT ends far behind it, the report says so.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import Required, TypedDict

from .data.datasets import Images, iterate_batches

FAR_BEHIND = 0.9  # the ViT is "far behind" below this fraction of the reference's accuracy


class ReferenceCNN(nn.Module):
    """conv-bn-relu-pool x 3, global average pool, linear: ~100k parameters."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32):
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for out in (width, width * 2, width * 4):
            layers += [nn.Conv2d(channels, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU(), nn.MaxPool2d(2)]
            channels = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, images: Tensor) -> Tensor:  # (B, C, H, W) in [0, 1] -> (B, classes)
        return self.head(self.features(images * 2 - 1).mean(dim=(-2, -1)))


@dataclass
class ReferenceResult:
    model: str
    val_acc: float
    seconds: float
    steps: int
    epochs: float


class LearnedRecord(TypedDict, total=False):
    """A manifest's `metrics.learned`: the kept epoch's validation accuracy against chance and the
    reference CNN (the arbitrary-order figures for shuffle-robust variants only), against always
    answering the most common class, and, for a family member, whose reference it was."""

    chance: Required[float]
    reference: Required[dict[str, Any]]  # ReferenceResult's fields
    vit_val_sequential: float
    vit_val_arbitrary: float
    ratio_val_sequential: float | None  # None: the reference scored 0, and a ratio says nothing
    ratio_val_arbitrary: float | None
    reference_from: str  # a family member: its base, whose reference this is
    majority_baseline: float


@torch.no_grad()
def accuracy(model: nn.Module, x: Images, y: Tensor, workers: int = 0, batch_size: int = 256) -> float:
    model.eval()
    chunks = [torch.arange(i, min(i + batch_size, len(y))) for i in range(0, len(y), batch_size)]
    correct = sum(
        int((model(images).argmax(-1) == y[idx]).sum())
        for idx, images in zip(chunks, iterate_batches(x, chunks, workers), strict=True)
    )
    return correct / len(y)


def train_reference(
    train: tuple[Images, Tensor],
    val: tuple[Images, Tensor],
    num_classes: int,
    budget_s: float,
    seed: int = 0,
    batch_size: int = 128,
    workers: int = 0,
) -> ReferenceResult:
    """Train a ReferenceCNN for `budget_s` seconds of wall clock (whole steps), then measure it on `val`."""
    torch.manual_seed(seed)
    (x, y), (val_x, val_y) = train, val
    first = x[torch.arange(1)] if isinstance(x, Tensor) else next(iterate_batches(x, [torch.arange(1)]))
    model = ReferenceCNN(int(first.shape[1]), num_classes)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=5e-4)
    gen = torch.Generator().manual_seed(seed)
    started, steps = time.perf_counter(), 0
    model.train()
    while time.perf_counter() - started < budget_s:
        perm = torch.randperm(len(y), generator=gen)
        batches = [perm[i : i + batch_size] for i in range(0, len(y), batch_size)]
        for idx, images in zip(batches, iterate_batches(x, batches, workers), strict=True):
            loss = F.cross_entropy(model(images), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            steps += 1
            if time.perf_counter() - started >= budget_s:
                break
        model.train()
    seconds = time.perf_counter() - started
    epochs = steps * batch_size / max(1, len(y))
    return ReferenceResult(
        "cnn-3x32", accuracy(model, val_x, val_y, workers), round(seconds, 1), steps, round(epochs, 2)
    )


def compare(vit_acc: dict[str, float], reference: ReferenceResult, num_classes: int) -> LearnedRecord:
    """The record written into the manifest: the ViT's accuracies (`val_sequential`, and `val_arbitrary`
    when measured) against chance and the reference."""
    ref = reference.val_acc  # at zero a ratio says nothing (it read 1e9): None
    sequential, arbitrary = vit_acc["val_sequential"], vit_acc.get("val_arbitrary")
    record: LearnedRecord = {"chance": round(1.0 / num_classes, 4), "reference": asdict(reference)}
    record["vit_val_sequential"] = round(sequential, 4)
    if arbitrary is not None:
        record["vit_val_arbitrary"] = round(arbitrary, 4)
    record["ratio_val_sequential"] = round(sequential / ref, 3) if ref > 0 else None
    if arbitrary is not None:
        record["ratio_val_arbitrary"] = round(arbitrary / ref, 3) if ref > 0 else None
    return record


def far_behind_warning(vit_acc: dict[str, float], reference: ReferenceResult) -> str | None:
    """A warning when any of the ViT's validation accuracies is below FAR_BEHIND x the reference's."""
    behind = {k: v for k, v in vit_acc.items() if v < FAR_BEHIND * reference.val_acc}
    if not behind:
        return None
    shown = ", ".join(f"{k} {v:.3f}" for k, v in behind.items())
    return (
        f"warning: the ViT's validation accuracy ({shown}) is below {FAR_BEHIND:.0%} of a small CNN trained on the "
        f"same split for the same {reference.seconds:.0f} s ({reference.val_acc:.3f}): it has not learned what the "
        "data allows; train longer (--time-budget), or again with another --seed (a task learnt in a sudden jump, "
        "such as comparing distant objects, is left stuck by some seeds and not others), or in order "
        "(--variant baseline) and then `layerswarm family --base` it, or start from a pretrained ViT (--init hf:PATH)"
    )
