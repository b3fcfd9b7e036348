"""Self-speculative decoding through the swarm: the coordinator drafts, the route verifies.

    prefill   the prompt through the route (one trip) and, at the same time, through the local draft
    round     the newest token t and k drafts d1 .. dk, drafted here (models/lm/draft.py), then
              [t, d1 .. dk] through the whole route in ONE Decode per node (runner.advance: k + 1 rows
              from t's row), the head on the k + 1 outputs, and the acceptance rule (models/lm/accept.py):
              the kept drafts and one more token go to the caller; the nodes drop the rest themselves at
              the next round, whose Decode starts at the new token's row (a node truncates its cache to
              `start`: node/streams.py), and the draft's caches keep what was kept

Why the draft runs here and not on the route's first nodes: a draft through the first d nodes costs a
round trip over d hops for every drafted token, so k drafts and a verify would make k + 1 trips where
plain decoding makes one per token, and the trip is what bounds a swarm at batch 1. Drafted locally,
the k tokens cost a few small block evaluations beside the event loop, and the swarm sees one trip per
round: the fewest trips for the tokens a round yields. The draft's blocks are the model's own first d
(in the model's order); the route still runs every block, so the verify pass is plain decoding's own
computation and the output is exact (greedy: the same tokens; sampled: the same distribution).

Failures are the runner's (rebuild, skip, rewind after a lie): a verify is a step of k + 1 tokens like
any other, and its output's last k + 1 rows are always the newest tokens' (runner.advance). k is fixed
per request, or adapts (kcontrol.py) to the stream's acceptance and its measured draft and trip times.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from layerswarm.models import policy
from layerswarm.models.checkpoint import Manifest, load_block
from layerswarm.models.lm.accept import Verdict, judge
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.draft import Drafter, DraftStream, Proposal
from layerswarm.models.manifest import ModelDirError

from ..settings import CoordinatorSettings
from .kcontrol import KController
from .options import Speculation
from .runner import StreamFailed, StreamRunner
from .session import Delta, StreamSession

log = logging.getLogger(__name__)

DRAFT_POLICY = "draft"  # the policy key `layerswarm eval` writes (training/lm/commands.py)
DEFAULT_PRIOR = 0.5  # the acceptance an adaptive stream assumes before its first round, unevaluated
T = TypeVar("T")
Run = Callable[[Callable[[], Any]], Awaitable[Any]]  # runs a function on the stem-and-head thread


@dataclass(frozen=True)
class DraftPlan:
    depth: int  # the model's blocks 0 .. depth - 1 draft
    prior: float  # the acceptance expected before a stream measured its own
    source: str  # where the depth came from (logged)


def draft_plan(settings: CoordinatorSettings, manifest: Manifest[LMConfig]) -> DraftPlan | None:
    """--draft-depth, else the evaluated best draft (the policy's), else a third of the depth; None for
    a model of one block (nothing to draft with). Raises ValueError for a depth not under the model's."""
    depth = manifest.config.depth
    evaluated = policy.entry(manifest, DRAFT_POLICY) or {}
    acceptance = evaluated.get("acceptance")
    prior = float(acceptance) if isinstance(acceptance, (int, float)) and 0 < acceptance < 1 else DEFAULT_PRIOR
    if settings.draft_depth is not None:
        if settings.draft_depth >= depth:
            raise ValueError(f"--draft-depth {settings.draft_depth} must be under the model's depth of {depth}")
        return DraftPlan(settings.draft_depth, prior, "--draft-depth")
    if depth < 2:
        return None
    chosen = evaluated.get("draft_depth")
    if isinstance(chosen, int) and 1 <= chosen < depth:
        return DraftPlan(chosen, prior, "the model's evaluated policy")
    return DraftPlan(max(1, depth // 3), DEFAULT_PRIOR, "a third of the depth (never evaluated)")


def load_drafter(
    settings: CoordinatorSettings, manifest: Manifest[LMConfig], plan: DraftPlan, stem: nn.Module, head: nn.Module
) -> Drafter:
    """The model's first plan.depth blocks, verified as a node verifies its one."""
    blocks = [load_block(settings.model_dir, i, manifest) for i in range(plan.depth)]
    return Drafter(manifest.config, stem, blocks, head)


class SpeculationObserver(Protocol):
    def speculation_round(self, drafted: int, accepted: int) -> None: ...


@dataclass
class _Draft:
    stream: DraftStream
    control: KController
    ask: Speculation

    def k(self) -> int:
        return self.control.next_k() if self.ask.adaptive else self.ask.k


class Speculator:
    """Speculative streams of one model. The draft's blocks are loaded (and verified) by the first stream
    that asks for speculation, not at start: a server whose clients never ask keeps no copy of them."""

    def __init__(
        self,
        load: Callable[[], Drafter],
        runner: StreamRunner,
        stem: torch.nn.Module,
        head: torch.nn.Module,
        run: Run,
        observer: SpeculationObserver | None = None,
        prior_acceptance: float = DEFAULT_PRIOR,
        run_short: Run | None = None,
    ) -> None:
        self._load, self.runner, self.stem, self.head = load, runner, stem, head
        self._run = run
        # A round's draft and verdict: on the event loop where the generator finds that cheaper (a lone
        # stream's short calls: generator._run_short), else on the thread like the rest.
        self._run_short = run_short or run
        self.observer = observer
        self.prior_acceptance = prior_acceptance
        self.drafts: dict[str, _Draft] = {}
        self.learned: KController | None = None  # the last adaptive stream's measurements: the next one's start
        self._drafter: Drafter | None = None
        self._loading = asyncio.Lock()

    async def drafter(self) -> Drafter:
        async with self._loading:
            if self._drafter is None:
                try:
                    self._drafter = await self.run(self._load)
                except (ModelDirError, OSError) as exc:  # the model directory changed under us: say so, as a 503
                    log.error("speculation: the draft's blocks could not be loaded: %s", exc)
                    raise StreamFailed(f"speculation is unavailable: the draft could not be loaded ({exc})") from exc
                log.info("speculation: draft loaded, %d blocks", self._drafter.depth)
            return self._drafter

    async def run(self, fn: Callable[[], T]) -> T:
        result: T = await self._run(fn)
        return result

    async def prefill(self, s: StreamSession, x: torch.Tensor, ask: Speculation) -> torch.Tensor:
        """x (1, P, D): the prompt's embeddings. The route's logits (1, V) for the first token; the
        draft's caches hold the prompt."""
        drafter = await self.drafter()
        control = self.learned.fork() if self.learned is not None else KController(acceptance=self.prior_acceptance)
        draft = self.drafts[s.id] = _Draft(drafter.stream(), control, ask)
        s.speculation.ask, s.speculation.draft_depth = ask, drafter.depth
        out, _ = await asyncio.gather(self.runner.advance(s, x, 0), self.run(lambda: draft.stream.prefill(s.prompt)))
        s.trips += 1
        return await self.run(lambda: self.head(out[:, -1]))

    def forget(self, s: StreamSession) -> None:
        draft = self.drafts.pop(s.id, None)
        if draft is not None and draft.control.rounds:  # the route's trip and draft times outlive a stream
            self.learned = draft.control

    async def tokens(self, s: StreamSession, logits: torch.Tensor) -> AsyncIterator[Delta]:
        """The stream's tokens from the prefill's logits on, a verify trip per round. Raises StreamFailed."""
        draft = self.drafts[s.id]
        first = await self.run(lambda: self._verdict(s, logits, draft.stream.first(s.sampling, 0), 0))
        pending = [first.token]
        while True:
            for token in pending:
                text, finish = s.accept(token)
                yield Delta(text, None if token == s.eos_id else token, finish)
                if finish is not None:
                    s.finish_reason = finish
                    return
            pending = await self._round(s, draft)

    async def _round(self, s: StreamSession, draft: _Draft) -> list[int]:
        """One round: drafts, a verify trip, the verdict. The tokens for the caller, kept drafts first."""
        started = time.monotonic()
        room = s.limit - len(s.generated)  # tokens the caller may still get; a round yields up to span + 1
        span = max(0, min(draft.k(), room - 1))
        ids, position = s.prompt + s.generated, len(s.generated)

        def drafted() -> tuple[Proposal, torch.Tensor]:  # one hand-off to the compute thread, not two
            proposal = draft.stream.propose(ids, span, s.sampling, position)
            return proposal, self.stem(torch.tensor([[ids[-1], *proposal.drafts[:span]]]))

        proposal, x = await self._run_short(drafted)
        drafted_at = time.monotonic()
        row = s.length - 1  # the newest token's row: the nodes' caches are cut back to it
        out = await self.runner.advance(s, x, row)
        verdict = await self._run_short(lambda: self._verdict(s, self.head(out[0, -(span + 1) :]), proposal, position))
        verified_at = time.monotonic()
        s.trips += 1
        draft.stream.keep(len(ids) + verdict.accepted)
        draft.control.observe(span, verdict.accepted, drafted_at - started, verified_at - drafted_at)
        s.speculation.round(span, verdict.accepted)
        if self.observer is not None:
            self.observer.speculation_round(span, verdict.accepted)
        return [*proposal.drafts[: verdict.accepted], verdict.token]

    @staticmethod
    def _verdict(s: StreamSession, logits: torch.Tensor, proposal: Proposal, position: int) -> Verdict:
        """logits (n + 1, V) or (1, V) against the proposal's drafts (on the compute thread)."""
        return judge(logits.float(), proposal.drafts, s.sampling, proposal.q, position)
