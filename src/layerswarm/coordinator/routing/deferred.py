"""Deferred ("optimistic") verification: one request's pending spot checks, and where a rewind goes.

Why: a sampled hop's re-execution (~50 ms for a ViT-B/16 block on the coordinator, or calls to
replicas) used to sit in the request's critical path, ~10 % of a 12-hop request's latency, while the
coordinator was idle waiting for the next node. Now the executor screens each reply at once (range
filters: a hard violation still convicts its sender on the spot) and only *starts* the confirmation
(verification/verifier.py: `Verifier.screen` / `confirm`), continuing with the node's output. The answer is never
returned, nor an early exit taken, before every confirmation of the activations it came from passed.

A failed confirmation rewinds the path to that hop (executor.py): its node is quarantined with the
evidence (a failed attempt of that hop, as before), the hops after it are discarded (their inputs
derive from the lie: their pending checks are cancelled and nobody is blamed for them) and the path
resumes from the hop's input with the hop's next alternative. A later hop that fails while earlier
checks are pending waits for them first: when one of them lied, the later node is not blamed.

This module only keeps the checks in path order and awaits them; the executor decides what they mean.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..membership.records import NodeRecord
from ..verification.verifier import Lie, Screened, Verifier
from .hop_call import HopResult
from .trace import Hop

# Each rewind convicts a distinct node, so rewinds are bounded by the nodes; past this many in one
# request its remaining hops are checked blocking (which never rewinds) rather than trust that bound.
MAX_REWINDS = 3


@dataclass
class PendingCheck:
    """A hop whose confirmation runs while the path goes on: what a rewind to it restores."""

    step: int  # the plan step
    hop_index: int  # its Hop in the path's hops
    hop: Hop
    x: torch.Tensor  # the hop's input
    record: NodeRecord  # the node whose reply is being checked
    used: frozenset[int]  # block indices that had run before the hop
    exit_state: Any  # the early-exit rule's state before the hop (None: no rule, or a stateless one)
    task: asyncio.Future[Lie | None]  # the confirmation: the Lie that convicted the node, or None
    discarded: bool = False  # a rewind to an earlier hop threw this hop away

    @property
    def lie(self) -> Lie | None:
        if not self.task.done() or self.task.cancelled():
            return None
        return self.task.result()


@dataclass
class PendingChecks:
    """One request's checks in path order (every hop before the current one that is being confirmed)."""

    checks: list[PendingCheck] = field(default_factory=list)
    rewinds: int = 0

    def add(self, check: PendingCheck) -> None:
        self.checks.append(check)
        self.checks.sort(key=lambda c: c.hop_index)  # path order (a decisive check comes after the path)

    def snapshot(self) -> tuple[PendingCheck, ...]:
        """The checks a hop starting now depends on (its input derives from their hops)."""
        return tuple(self.checks)

    @staticmethod
    async def first_bad(checks: Sequence[PendingCheck]) -> PendingCheck | None:
        """Await `checks` in path order; the first that failed (or was discarded by a rewind), else None.
        The ones after a failed check are not awaited: their hops derive from its lie. Waiting never
        cancels a check (asyncio.wait); an error other than Lie in a check is raised (a bug)."""
        for check in checks:
            if not check.task.done():
                await asyncio.wait({check.task})
            if check.discarded or check.task.cancelled() or check.task.result() is not None:
                return check
        return None

    def drop_from(self, culprit: PendingCheck) -> list[PendingCheck]:
        """Forget `culprit` and every later check: the later ones still running are cancelled (their hops
        are discarded: nobody is blamed). Returns the later ones that had already failed: their lie is
        their own (re-executed from the very input their node got), so their nodes are convicted too."""
        index = self.checks.index(culprit)
        later = self.checks[index + 1 :]
        del self.checks[index:]
        for check in later:
            check.discarded = True
            if not check.task.done():
                check.task.cancel()
        return [check for check in later if check.lie is not None]

    def cancel_all(self) -> None:
        """The request is over (answered, failed or cancelled): stop whatever is still running."""
        for check in self.checks:
            if not check.task.done():
                check.discarded = True
                check.task.cancel()


@dataclass
class Done:
    """A hop that answered and whose output the path went on with: what a check of it needs later
    (the answer's decisive hop is known only after the last one: executor.py, _check_decisive)."""

    step: int
    hop_index: int
    hop: Hop
    x: torch.Tensor  # its input
    record: NodeRecord
    used: frozenset[int]
    exit_state: Any
    result: HopResult
    checked: bool  # re-executed already in this request (or being re-executed)


@dataclass
class Walk:
    """Where a request's path stands (executor.py); a rewind sets it back to a hop's start."""

    x: torch.Tensor
    step: int = 0
    hops: list[Hop] = field(default_factory=list)
    redo: Hop | None = None  # the hop of `step` to run again (its failed attempts kept)
    discarded: list[Hop] = field(default_factory=list)  # hops thrown away by rewinds, for the trace
    done: list[Done] = field(default_factory=list)  # the hops the current activations came through, in order

    def back_to(self, check: PendingCheck) -> None:
        """Discard the hops after `check`'s; go back to its input and step (its hop runs again)."""
        self.done = [d for d in self.done if d.hop_index < check.hop_index]
        for hop in self.hops[check.hop_index + 1 :]:
            if hop.node is not None or hop.attempts:
                hop.outcome = "discarded"
                self.discarded.append(hop)
        old = check.hop
        self.redo = type(old)(position=old.position, planned_block=old.planned_block, repeat=old.repeat)
        self.redo.attempts = old.attempts
        del self.hops[check.hop_index :]
        self.x, self.step = check.x, check.step


def exit_state(rule: object) -> Any:
    """The early-exit rule's state before a hop (a patience streak: exits.RouteExit), None when stateless."""
    save = getattr(rule, "save", None)
    return save() if save is not None else None


def restore_exit_state(rule: object, state: Any) -> None:
    if state is not None:
        getattr(rule, "restore")(state)  # noqa: B009 (any exit rule with a state has it)


async def confirmed(verifier: Verifier, screened: Screened) -> Lie | None:
    """A deferred check: the Lie that convicts the node (or contests its weights), or None when its
    reply passed."""
    try:
        await verifier.confirm(screened)
    except Lie as lie:
        return lie
    return None


class Rewind(Exception):
    """Raised from a hop whose own failure may stem from an earlier lie: `check` failed, go back to it."""

    def __init__(self, check: PendingCheck) -> None:
        super().__init__(f"rewind to step {check.step}")
        self.check = check
