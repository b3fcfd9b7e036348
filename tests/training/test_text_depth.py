"""Per-token depth estimates point the right way, and frozen tokens are really not computed: a quick
in-process check of what `layerswarm depth` and the swarm rely on."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from layerswarm.coordinator.routing.hop_call import text_reply
from layerswarm.models.config import ViTConfig
from layerswarm.models.text.depth import token_depths
from layerswarm.models.text.model import TextEncoder
from layerswarm.models.text.tokenizer import CLS_ID, PAD_ID
from layerswarm.models.text.tokens import hop_mask
from layerswarm.training.text.depth import mi_depths
from layerswarm.training.text.depth_eval import run_with_depths
from layerswarm.training.text.reconstruction import depths_from_losses, reconstruction_depths
from layerswarm.wire import codec

CFG = ViTConfig(kind="text", vocab_size=12, max_tokens=8, num_classes=2, dim=16, heads=2, depth=4)
LABEL_WORD = {0: 4, 1: 5}  # token 4 is in every label-0 sentence, token 5 in every label-1 sentence


def labelled_sentences(n: int = 400, seed: int = 0) -> tuple[Tensor, Tensor]:
    """[CLS], the label's word, then 4 random fillers (ids 6..11, independent of the label)."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(2, (n,), generator=gen)
    fillers = torch.randint(6, 12, (n, 4), generator=gen)
    key = torch.tensor([LABEL_WORD[int(y)] for y in labels])[:, None]
    ids = torch.cat([torch.full((n, 1), CLS_ID), key, fillers, torch.full((n, 2), PAD_ID)], dim=1)
    return ids, labels


def test_mi_sends_label_words_shallow_and_fillers_deeper() -> None:
    """The paper's direction: high MI -> small -log MI -> first bin. Inverting it fails here."""
    ids, labels = labelled_sentences()
    depth = mi_depths(ids, labels, CFG.vocab_size, 2, bins=4)
    assert depth[4] == depth[5] == 1
    assert min(depth[6:12]) > 1  # label-free fillers: MI near 0, -log MI large
    assert depth[CLS_ID] == 4  # in every sentence: no information, full depth


def test_reconstruction_penalty_favours_shallow_layers() -> None:
    """argmin_n(loss_n + 0.1 n): a word whose loss no block improves stops at 1; a word each block
    helps by more than 0.1 nats goes deep. The printed '- 0.1 n' would send the flat word to 4."""
    losses = torch.tensor(
        [
            [3.7, 3.7, 3.7, 3.7],  # unpredictable filler
            [3.0, 2.0, 1.0, 0.5],  # context helps at every layer
            [3.0, 1.0, 0.98, 0.97],  # helps once, then by less than lambda
        ]
    )
    table = torch.zeros(CFG.vocab_size, 4)
    table[4:7] = losses  # ids 0..3 are the special tokens
    assert depths_from_losses(table, torch.ones(CFG.vocab_size))[4:7] == [1, 4, 2]


def test_reconstruction_estimate_runs_and_gives_cls_full_depth() -> None:
    ids, _ = labelled_sentences(60)
    torch.manual_seed(0)
    depth, losses = reconstruction_depths(TextEncoder(CFG), ids, max_sentences=20, steps=3)
    assert len(depth) == CFG.vocab_size and all(1 <= d <= 4 for d in depth)
    assert depth[CLS_ID] == 4 and len(losses["6"]) == 4
    policy = {"mi": depth, "reconstruction": depth}
    assert token_depths(policy, "reconstruction", ids[:2])[:, 0].tolist() == [4, 4]


class CountingMlp(nn.Module):
    """Wraps a block's MLP and counts the token rows it is asked to compute."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.rows = inner, 0

    def forward(self, x: Tensor) -> Tensor:
        self.rows += x.shape[0] * x.shape[1]
        out: Tensor = self.inner(x)
        return out


def test_frozen_tokens_are_not_computed() -> None:
    """With depths, each block's MLP sees only the tokens still active (batch 1: no row padding), and
    a frozen token's state leaves the block unchanged."""
    torch.manual_seed(0)
    model = TextEncoder(CFG).eval()
    counters = []
    for block in model.blocks:
        counter = CountingMlp(block.mlp)
        block.mlp = counter  # type: ignore[assignment]
        counters.append(counter)
    ids = torch.tensor([[CLS_ID, 4, 6, 7, 8]])
    depth = torch.tensor([[4, 1, 2, 3, 1]])
    _, computed = run_with_depths(model, ids, list(model.blocks), depth)
    assert [c.rows for c in counters] == [5, 3, 2, 1] and computed == 11
    full_logits, _ = run_with_depths(model, ids, list(model.blocks), None)
    depth_logits, _ = run_with_depths(model, ids, list(model.blocks), depth)
    assert not torch.allclose(full_logits, depth_logits)  # frozen words were not updated


def test_training_forward_with_depths_matches_serving() -> None:
    """`train --token-depth`: the encoder's own forward with a depth table gives what the swarm's
    active-tokens-only path gives, in any block order."""
    torch.manual_seed(1)
    model = TextEncoder(CFG).eval()
    table = torch.tensor([4, 4, 4, 4, 1, 1, 2, 3, 1, 2, 1, 2])
    ids, _ = labelled_sentences(6)
    order = [2, 0, 3, 1]
    served, _ = run_with_depths(
        model, ids, [model.blocks[i] for i in order], token_depths({"mi": table.tolist()}, "mi", ids)
    )
    model.token_depth_table = table
    with torch.inference_mode():
        trained = model(ids, order)
    torch.testing.assert_close(trained, served, rtol=1e-5, atol=1e-5)


def test_a_reply_carrying_frozen_tokens_is_refused() -> None:
    """The coordinator takes exactly the active tokens back: a reply with every token (frozen ones
    included) is a malformed reply (the node gets quarantined), not silently scattered."""
    x = torch.randn(1, 5, 16)
    mask = hop_mask(torch.ones(1, 5, dtype=torch.bool), torch.tensor([[4, 1, 2, 1, 1]]), 1)  # 2 active
    good = text_reply(x, mask, codec.encode(torch.randn(2, 16)), torch.float32)
    assert torch.equal(good[0, [1, 3, 4]], x[0, [1, 3, 4]])  # frozen states untouched
    with pytest.raises(codec.TensorError):
        text_reply(x, mask, codec.encode(torch.randn(5, 16)), torch.float32)
