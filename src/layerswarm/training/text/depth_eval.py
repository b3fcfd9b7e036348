"""Per-token depth, measured: accuracy and mean depth per token for fixed depth vs the MI and
reconstruction estimates, in sequential and arbitrary block order (what `layerswarm depth` reports).

Frozen tokens are computed exactly as a node computes them (models/text/tokens.run_active: active tokens get
queries and the MLP, frozen ones are only keys and values); depth counts hops run, whatever the order.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from layerswarm.models.text.depth import token_depths
from layerswarm.models.text.model import key_mask_of
from layerswarm.models.text.tokens import ACTIVE_CODE, hop_mask, run_active, scatter_active
from layerswarm.models.vit import ViT


@torch.inference_mode()
def run_with_depths(model: ViT, ids: Tensor, blocks: Sequence[nn.Module], depth: Tensor | None) -> tuple[Tensor, int]:
    """Logits and tokens computed for `ids` through `blocks`, freezing each token after its depth."""
    key = key_mask_of(ids)
    x, computed = model.stem(ids), 0
    for hops_run, block in enumerate(blocks):
        mask = hop_mask(key, depth, hops_run)
        if not bool((mask == ACTIVE_CODE).any()):
            break  # every token froze: the path ends here
        computed += int((mask == ACTIVE_CODE).sum())
        x = scatter_active(x, mask, run_active(block, x, hops_run, mask))  # type: ignore[arg-type]
    return model.head(x), computed


def evaluate_depths(
    model: ViT,
    ids: Tensor,
    labels: Tensor,
    policy: Mapping[str, object],
    orders: int = 5,
    seed: int = 0,
    batch: int = 500,
) -> dict[str, Any]:
    """Per estimate (full, fixed at the MI mean, mi, reconstruction) and order: accuracy, mean depth per
    real token, tokens computed per sentence (vs full depth)."""
    depth_n = len(model.blocks)
    rng = random.Random(seed)
    real = key_mask_of(ids)
    tables: dict[str, Tensor | None] = {"full": None}
    for estimate in ("mi", "reconstruction"):
        tables[estimate] = token_depths(policy, estimate, ids)
    mi_mean = float(tables["mi"][real].float().mean())  # type: ignore[index]
    fixed = max(1, round(mi_mean))
    tables[f"fixed-{fixed}"] = torch.where(real, fixed, 0)
    block_list = list(model.blocks)
    sequences = {"sequential": [block_list], "arbitrary": [rng.sample(block_list, depth_n) for _ in range(orders)]}
    out: dict[str, Any] = {}
    for name, depth in tables.items():
        per_token = torch.full_like(ids, depth_n) if depth is None else depth.clamp(max=depth_n)
        row: dict[str, Any] = {"mean_depth_per_token": round(float(per_token[real].float().mean()), 3)}
        for order_name, orders_list in sequences.items():
            accs, tokens = [], []
            for blocks in orders_list:
                correct, computed = 0, 0
                for s in range(0, len(labels), batch):
                    d = None if depth is None else depth[s : s + batch]
                    logits, n = run_with_depths(model, ids[s : s + batch], blocks, d)
                    correct += int((logits.argmax(-1) == labels[s : s + batch]).sum())
                    computed += n
                accs.append(correct / len(labels))
                tokens.append(computed / len(labels))
            row[order_name] = {
                "accuracy": round(statistics.fmean(accs), 4),
                "tokens_computed_per_sentence": round(statistics.fmean(tokens), 3),
            }
        out[name] = row
    full_tokens = out["full"]["sequential"]["tokens_computed_per_sentence"]
    for row in out.values():
        row["compute_reduction"] = round(full_tokens / max(row["sequential"]["tokens_computed_per_sentence"], 1e-9), 3)
    return out
