"""A shallow draft of a decoder: the stem, the first d blocks and the shared head, one KV cache per stream.

    DraftStream.prefill(prompt)        the prompt through the draft blocks: q for the first generated token
    DraftStream.propose(ids, span, s)  catch up on ids the caches lack, then draw `span` drafts one at a
                                       time (greedy: argmax; sampled: from q, keyed by position: accept.py)
    DraftStream.keep(n)                forget every token after the first n (the rejected drafts)

What a coordinator runs beside the swarm (coordinator/generation/speculate.py): it drafts locally, so
drafting costs no network trip at all, and the swarm only verifies. Batch 1, as a stream is.

The blocks run in numpy (models/lean/decoder.py, the same weights in float32): a token through a small
block is a few dozen tiny operations, each several times cheaper in numpy than in torch eager (measured
here: 0.18 against 0.58 ms a block for the shipped 64-wide family). A draft need not match the verifier
bit for bit: whatever it proposes, the acceptance rule keeps the output exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from ..lean import decoder as lean
from .accept import DRAFT, draft_probs, draw
from .config import LMConfig
from .generate import Sampling


@dataclass(frozen=True)
class Proposal:
    """Greedy: `span` drafts, q None. Sampled: span + 1 drafts (the last drawn at the bonus position) and
    q (span + 1, V), the draft's probabilities they were drawn from."""

    drafts: list[int]
    q: Tensor | None


class Drafter:
    """The draft's modules, shared by every stream (inference only): the torch stem and head, and the
    given torch blocks' weights in numpy blocks."""

    def __init__(self, cfg: LMConfig, stem: nn.Module, blocks: Sequence[nn.Module], head: nn.Module) -> None:
        if not blocks:
            raise ValueError("a draft needs at least one block")
        self.stem, self.head = stem, head
        self.blocks = [lean.DecoderBlock(cfg, _numpy_weights(block)) for block in blocks]

    @property
    def depth(self) -> int:
        return len(self.blocks)

    def stream(self) -> DraftStream:
        return DraftStream(self)


class DraftStream:
    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.caches = [block.new_cache() for block in drafter.blocks]
        self._last_logits: Tensor | None = None  # (V,) after the newest token in the caches

    @property
    def length(self) -> int:
        """Tokens the draft's caches hold."""
        return self.caches[0].length

    @torch.inference_mode()
    def _feed(self, ids: Sequence[int]) -> Tensor:
        """ids after the cached ones -> (V,) draft logits after the last of them."""
        x = self.drafter.stem(torch.tensor([list(ids)])).float().numpy()
        for block, cache in zip(self.drafter.blocks, self.caches, strict=True):
            x = block(x, caches=[cache])
        logits: Tensor = self.drafter.head(torch.from_numpy(x[:, -1]))[0]
        self._last_logits = logits
        return logits

    def prefill(self, prompt: Sequence[int]) -> Tensor:
        """The prompt into empty caches -> (V,) the draft's logits for the first generated token."""
        if self.length:
            raise ValueError("prefill needs empty draft caches")
        return self._feed(prompt)

    def keep(self, n: int) -> None:
        """Forget every token after the first n (n at most what is held)."""
        if n < self.length:
            for cache in self.caches:
                cache.truncate(n)
            self._last_logits = None

    def propose(self, ids: Sequence[int], span: int, sampling: Sampling, position: int) -> Proposal:
        """ids: the whole sequence so far (prompt and generated, the newest token last), of which the
        caches hold a prefix. `position`: the generated index of the first draft (keys sampled draws)."""
        if len(ids) <= self.length or span < 0:
            raise ValueError(f"the draft holds {self.length} of {len(ids)} tokens: nothing new to draft from")
        logits = self._feed(ids[self.length :])
        drafts: list[int] = []
        qs: list[Tensor] = []
        with torch.inference_mode():
            draws = span if sampling.greedy else span + 1  # sampled: the bonus position's too
            for i in range(draws):
                if sampling.greedy:
                    token = int(logits.argmax())
                else:
                    q = draft_probs(logits[None], sampling)[0]
                    assert sampling.seed is not None
                    token = draw(q, sampling.seed, position + i, DRAFT)
                    qs.append(q)
                drafts.append(token)
                if i < draws - 1:
                    logits = self._feed([token])
        return Proposal(drafts, torch.stack(qs) if qs else None)

    def first(self, sampling: Sampling, position: int = 0) -> Proposal:
        """The draft for the first generated token (sampled decoding judges it like any other), from the
        prefill's logits."""
        if self._last_logits is None:
            raise ValueError("no logits: prefill first")
        if sampling.greedy:
            return Proposal([], None)
        q = draft_probs(self._last_logits[None], sampling)
        assert sampling.seed is not None
        return Proposal([draw(q[0], sampling.seed, position, DRAFT)], q)


def _numpy_weights(block: nn.Module) -> lean.Weights:
    """A torch block's tensors as the numpy block takes them (the same names: Hugging Face's Llama ones)."""
    return {name: np.ascontiguousarray(t.detach().float().numpy()) for name, t in block.state_dict().items()}
