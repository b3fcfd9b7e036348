"""Output verification: catch nodes whose activations are well-formed but wrong, with evidence.

Every reply passes two layers (layer 1 before it is used; layer 2 before the answer it leads to is
returned: routing/deferred.py runs it while the path goes on, `check` runs both at once):

1. A range filter (every hop, no compute): the reply's largest |x| and per-image RMS against the
   activation statistics recorded at evaluation for that position (the `activation_stats` policy of
   the coordinator's own model directories), with a wide margin; and a hard bound of half the wire
   dtype's limit (a residual block adds to its input: past that, the next honest hop overflows). A
   hard violation quarantines the node that sent it (not the next one). A soft violation (an odd
   upload can look odd too) only forces layer 2 for this hop.
2. Spot re-execution: every hop of a node on probation (its first `probation_hops` hops per boot id),
   every flagged hop, and a `rate` fraction of the rest are recomputed by the coordinator with a
   verified copy of the block the node claims to run (same model id and block index, sha256 checked,
   loaded from --model-dir/--family-dir), from the same fp16-rounded input. Disagreement beyond the
   wire dtype's rounding quarantines the node; the evidence goes to /v1/nodes. When the coordinator
   holds no copy of that model (an unlisted model, non-strict mode), the reference is the family
   envelope: the same block index of every member it holds; the reply must lie closer to one of them
   than the members lie to each other (times `envelope_slack`). With `reexecute_on` "peers" (or
   "auto" for a model the coordinator does not hold), the hop goes to one or two other nodes that serve
   the same weights hash instead, judged by majority (peer_check.py).

Cost: one block forward per verified hop, on the coordinator or on a replica (counted in `stats()`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import torch

from layerswarm.models.checkpoint import Manifest, load_block, read_manifest
from layerswarm.models.text.tokens import run_active, scatter_active
from layerswarm.models.vit import Block
from layerswarm.wire import codec

from ..membership.records import Evidence, NodeRecord
from .peer_check import Ask, PeerVerdict, judge, order_referees
from .ranges import hard_range_problem, position_ranges, range_problem

log = logging.getLogger(__name__)

# Relative RMS error allowed between a node's reply and the coordinator's re-execution: a few times the
# rounding of one cast to the wire dtype (the only difference between two honest computations).
# int8 (per-row scales) rounds to 1/254 of each row's peak: about 1% RMS on real activations.
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 4e-2, torch.float32: 1e-4, torch.int8: 3e-2}


@dataclass(frozen=True)
class VerifySettings:
    rate: float = 0.05  # fraction of hops re-executed after probation
    probation_hops: int = 2  # every hop of a new node incarnation is checked until it has passed this many
    envelope_slack: float = 1.5  # unlisted models: how much further than members lie from each other
    # where a checked hop is re-executed: "coordinator" (its verified copy; the envelope for unlisted
    # models), "peers" (replicas with the same weights hash; the coordinator breaks ties and stands in
    # when no replica is up), "auto" (the coordinator when it holds the model, else peers)
    reexecute_on: str = "auto"
    # re-execute concurrently with the rest of the path (routing/deferred.py): the answer still waits for every
    # check, a failed one rewinds the path to that hop. False: each check blocks its hop, as before.
    deferred: bool = True


class Detection(Evidence):
    """A node caught lying, or a disagreement nobody could settle: whose reply, and the evidence."""

    address: str


class VerifyReport(TypedDict):
    """What the verifier did (for operators and the rogue-node bench): its settings, counts, findings."""

    rate: float
    probation_hops: int
    hops_seen: int
    hops_reexecuted: int
    hops_flagged_by_range: int
    reexecute_ms_total: float
    reexecute_on: str
    hops_reexecuted_on_peers: int
    peer_calls: int
    unresolved_disagreements: int
    convicted: int
    deferred: bool
    hops_confirmed_deferred: int
    rewinds: int
    detections: list[Detection]
    disagreements: list[Detection]


class Lie(Exception):
    """A reply that failed verification; `evidence` says what was checked, against what, how far off."""

    def __init__(self, message: str, evidence: Evidence) -> None:
        super().__init__(message)
        self.evidence = evidence


@dataclass
class _Seen:
    boot_id: str
    first_hop: float
    hops: int = 0
    passed: int = 0


@dataclass
class Screened:
    """A hop that screening chose for re-execution: what its confirmation needs (Verifier.confirm)."""

    record: NodeRecord
    seen: _Seen
    x: torch.Tensor
    out: torch.Tensor
    position: int
    wire: torch.dtype
    soft: Evidence | None  # the range filter's finding, when it forced the check
    token_mask: torch.Tensor | None
    sent: torch.Tensor | None
    replicas: Callable[[], list[NodeRecord]] | None
    ask: Ask | None


@dataclass
class VerifyStats:
    hops: int = 0
    reexecuted: int = 0
    reexecute_ms: float = 0.0
    flagged: int = 0
    peer_reexecuted: int = 0  # hops re-executed on replicas (each asks one or two)
    peer_calls: int = 0
    unresolved: int = 0  # one replica against another, no second opinion: nobody convicted
    convicted: int = 0  # nodes caught lying, ever (detections keeps the last 100)
    deferred: int = 0  # re-executions run while the path went on (counted by the executor)
    rewinds: int = 0  # paths rewound to a hop whose deferred check failed
    detections: list[Detection] = field(default_factory=list)
    disagreements: list[Detection] = field(default_factory=list)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS of the difference over RMS of the reference (per whole batch)."""
    return float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-6))


class Verifier:
    def __init__(self, model_dirs: list[Path], settings: VerifySettings, seed: int | None = None) -> None:
        self.settings = settings
        self.manifests: dict[str, tuple[Path, Manifest]] = {}
        for d in model_dirs:
            m = read_manifest(d)
            self.manifests[m.model_id] = (d, m)
        self.ranges = position_ranges([m for _, m in self.manifests.values()])
        self._blocks: dict[tuple[str, int], Block] = {}
        self._seen: dict[str, _Seen] = {}
        self._rng = random.Random(seed)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")
        self.counters = VerifyStats()
        # set by the coordinator: quarantine a referee caught lying (a node other than the one checked)
        self.quarantine_referee: Callable[[str, str, Evidence], None] | None = None

    def wants(self, record: NodeRecord) -> bool:
        """Would a hop of `record` be re-executed (on probation, or sampled now)? Relay chains ask this
        before they plan: a hop that is to be checked runs star, where the coordinator sees it."""
        seen = self._seen.get(record.address)
        boot = record.identity.boot_id if record.identity else None
        on_probation = seen is None or seen.boot_id != boot or seen.passed < self.settings.probation_hops
        return on_probation or self._rng.random() < self.settings.rate

    async def check(self, *args: Any, **kwargs: Any) -> None:
        """Raise Lie when the reply is wrong; return when it passes: `screen`, then (when it chose the
        hop for re-execution) `confirm`, blocking. Same arguments as `screen`."""
        screened = self.screen(*args, **kwargs)
        if screened is not None:
            await self.confirm(screened)

    def screen(
        self,
        record: NodeRecord,
        x: torch.Tensor,
        out: torch.Tensor,
        position: int,
        wire: torch.dtype,
        force: bool = False,
        token_mask: torch.Tensor | None = None,
        replicas: Callable[[], list[NodeRecord]] | None = None,
        ask: Ask | None = None,
        sent: torch.Tensor | None = None,
    ) -> Screened | None:
        """Layer 1, no compute: raise Lie on a hard range violation; return the hop when it is to be
        re-executed (probation, flagged, forced, sampled), else None. `out`: the reply to `x` at `position`.
        `force`: re-execute whatever the sampling rate says (the hop was sampled already).
        token_mask: a text hop's mask (models/text/tokens.py): the reference computes the same tokens.
        sent: what the node decoded when it was not codec.as_sent(x, wire) (a split text hop).
        replicas, ask: the nodes serving the same weights (asked for only when the hop is re-executed),
        and how to send them this hop (peer_check.py)."""
        ident = record.identity
        if ident is None:
            return None
        seen = self._seen_for(record)
        seen.hops += 1
        self.counters.hops += 1
        hard = hard_range_problem(out, position, wire)
        if hard is not None:
            raise self._convict(record, seen, hard)
        soft = range_problem(self.ranges, out, position)
        on_probation = seen.passed < self.settings.probation_hops
        if soft is not None:
            self.counters.flagged += 1
        if soft is None and not on_probation and not force and self._rng.random() >= self.settings.rate:
            return None
        return Screened(record, seen, x, out, position, wire, soft, token_mask, sent, replicas, ask)

    async def confirm(self, hop: Screened) -> None:
        """Layer 2: re-execute a screened hop; raise Lie with the evidence, or count a pass (probation)."""
        record, seen, position, wire, token_mask = hop.record, hop.seen, hop.position, hop.wire, hop.token_mask
        assert record.identity is not None
        model_id, ask = record.identity.model_id, hop.ask
        peers = hop.replicas() if hop.replicas is not None and ask is not None and self._peers_first(model_id) else []
        x_sent = codec.as_sent(hop.x, wire) if hop.sent is None else hop.sent  # exactly what the node received
        if peers and ask is not None:
            verdict = await self._on_peers(record, hop.out, position, wire, peers, ask, x_sent, token_mask)
            if verdict is not None:
                if verdict.liar == record.address and verdict.evidence is not None:
                    raise self._convict(record, seen, {**verdict.evidence, "position": position})
                if verdict.passed:
                    seen.passed += 1
                return
        block = record.identity.block
        evidence = await self._reexecute(model_id, block, x_sent, hop.out, position, wire, token_mask)
        if evidence is not None:
            if hop.soft is not None:
                evidence["range_filter"] = hop.soft["discrepancy"]
            raise self._convict(record, seen, evidence)
        seen.passed += 1

    def stats(self) -> VerifyReport:
        c = self.counters
        return {
            "rate": self.settings.rate,
            "probation_hops": self.settings.probation_hops,
            "hops_seen": c.hops,
            "hops_reexecuted": c.reexecuted,
            "hops_flagged_by_range": c.flagged,
            "reexecute_ms_total": round(c.reexecute_ms, 3),
            "reexecute_on": self.settings.reexecute_on,
            "hops_reexecuted_on_peers": c.peer_reexecuted,
            "peer_calls": c.peer_calls,
            "unresolved_disagreements": c.unresolved,
            "convicted": c.convicted,
            "deferred": self.settings.deferred,
            "hops_confirmed_deferred": c.deferred,
            "rewinds": c.rewinds,
            "detections": c.detections,
            "disagreements": c.disagreements,
        }

    def forget(self, address: str) -> None:
        """A node left the registry: drop what was kept about it (nodes that come and go on new ports
        would otherwise each leave an entry behind for the life of the coordinator)."""
        self._seen.pop(address, None)

    @property
    def tracked(self) -> int:
        """Addresses with verification state (bounded by the registry's nodes)."""
        return len(self._seen)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- layer 2: re-execution on replicas -----------------------------------------------------------

    def _peers_first(self, model_id: str) -> bool:
        mode = self.settings.reexecute_on
        return mode == "peers" or (mode == "auto" and model_id not in self.manifests)

    def _trusted(self, address: str) -> bool:
        seen = self._seen.get(address)
        return seen is not None and seen.passed >= self.settings.probation_hops

    async def _on_peers(
        self,
        record: NodeRecord,
        out: torch.Tensor,
        position: int,
        wire: torch.dtype,
        replicas: list[NodeRecord],
        ask: Ask,
        x_sent: torch.Tensor,
        token_mask: torch.Tensor | None,
    ) -> PeerVerdict | None:
        """Majority judgement by replicas; None when none answered (the caller falls back). `x_sent`:
        what the node received."""
        assert record.identity is not None
        model_id, block = record.identity.model_id, record.identity.block
        out_wire = codec.as_sent(out, wire)

        async def counted_ask(peer: NodeRecord) -> torch.Tensor | None:
            self.counters.peer_calls += 1
            return await ask(peer)

        async def coordinator_copy() -> torch.Tensor | None:
            ref = await self._run([(model_id, block)], x_sent, position, token_mask)
            return ref[0]

        fallback = coordinator_copy if model_id in self.manifests else None
        referees = order_referees(replicas, self._trusted, self._rng)[:2]
        verdict = await judge(
            record,
            referees,
            counted_ask,
            lambda ref: relative_error(out_wire, codec.as_sent(ref, wire)),
            TOLERANCE[wire],
            fallback,
        )
        if verdict is None:
            return None
        self.counters.peer_reexecuted += 1
        if verdict.liar is not None and verdict.liar != record.address and verdict.evidence is not None:
            self._convict_referee(verdict.liar, {**verdict.evidence, "position": position})
        elif verdict.liar is None and not verdict.passed and verdict.evidence is not None:
            self.counters.unresolved += 1
            self.counters.disagreements.append({"address": record.address, **verdict.evidence, "at": time.time()})
            del self.counters.disagreements[:-100]  # bounded
            log.warning("unresolved disagreement on %s: %s", record.address, verdict.evidence)
        return verdict

    def _convict_referee(self, address: str, evidence: Evidence) -> None:
        seen = self._seen.get(address)  # None: it lied as a referee before any hop of its own was routed
        evidence = {
            **evidence,
            "hops_before_detection": seen.hops if seen else 0,
            "seconds_since_first_hop": round(time.monotonic() - seen.first_hop, 3) if seen else 0.0,
            "at": time.time(),
        }
        self._record_detection(address, evidence)
        log.warning("quarantining %s (a referee that lied) on evidence: %s", address, evidence)
        if self.quarantine_referee is not None:
            self.quarantine_referee(address, f"verification failed: {evidence['check']}", evidence)

    def _record_detection(self, address: str, evidence: Evidence) -> None:
        self.counters.convicted += 1
        self.counters.detections.append({"address": address, **evidence})
        del self.counters.detections[:-100]  # bounded

    # --- layer 2: re-execution on the coordinator ---------------------------------------------------

    async def _reexecute(
        self,
        model_id: str,
        block: int,
        x_wire: torch.Tensor,
        out: torch.Tensor,
        position: int,
        wire: torch.dtype,
        token_mask: torch.Tensor | None = None,
    ) -> Evidence | None:
        """None when `out` (the node's reply to `x_wire`, exactly what it received) agrees with a
        reference; otherwise the evidence."""
        known = model_id in self.manifests
        if not known and len(self.manifests) < 2:
            return None  # an unlisted model and no envelope to judge it by (one member held): unverifiable
        started = time.perf_counter()
        if known:
            refs = await self._run([(model_id, block)], x_wire, position, token_mask)
        else:
            refs = await self._run([(m, block) for m in self.manifests], x_wire, position, token_mask)
        self.counters.reexecuted += 1
        self.counters.reexecute_ms += (time.perf_counter() - started) * 1e3
        out_wire = codec.as_sent(out, wire)
        if known:
            err, tol = relative_error(out_wire, codec.as_sent(refs[0], wire)), TOLERANCE[wire]
            against = f"the coordinator's verified copy of {model_id} block {block}"
        else:
            err = min(relative_error(out_wire, r) for r in refs)
            spread = max((relative_error(a, b) for a in refs for b in refs if a is not b), default=0.0)
            tol = max(spread * self.settings.envelope_slack, TOLERANCE[wire])
            against = f"block {block} of the {len(refs)} family members the coordinator holds (unlisted model)"
        if err <= tol:
            return None
        return {
            "check": "re-execution",
            "against": against,
            "discrepancy": f"relative RMS error {err:.4g}",
            "tolerance": round(tol, 6),
            "position": position,
        }

    async def _run(
        self, keys: list[tuple[str, int]], x: torch.Tensor, position: int, token_mask: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        def reference(block: Block) -> torch.Tensor:
            if token_mask is None:
                return block(x, position)
            return scatter_active(x, token_mask, run_active(block, x, position, token_mask))

        def compute() -> list[torch.Tensor]:
            with torch.inference_mode():
                return [reference(self._block(model_id, index)) for model_id, index in keys]

        return await asyncio.get_running_loop().run_in_executor(self._pool, compute)

    def _block(self, model_id: str, index: int) -> Block:
        key = (model_id, index)
        if key not in self._blocks:
            model_dir, manifest = self.manifests[model_id]
            self._blocks[key] = load_block(model_dir, index, manifest)  # sha256 checked on load
        return self._blocks[key]

    # --- bookkeeping -----------------------------------------------------------------------------------

    def _seen_for(self, record: NodeRecord) -> _Seen:
        assert record.identity is not None
        seen = self._seen.get(record.address)
        if seen is None or seen.boot_id != record.identity.boot_id:  # a new incarnation starts on probation
            seen = _Seen(record.identity.boot_id, time.monotonic())
            self._seen[record.address] = seen
        return seen

    def _convict(self, record: NodeRecord, seen: _Seen, evidence: Evidence) -> Lie:
        evidence = {
            **evidence,
            "hops_before_detection": seen.hops,
            "seconds_since_first_hop": round(time.monotonic() - seen.first_hop, 3),
            "at": time.time(),
        }
        self._record_detection(record.address, evidence)
        log.warning("quarantining %s on evidence: %s", record.address, evidence)
        return Lie(f"verification failed: {evidence['check']} ({evidence['discrepancy']})", evidence)
