"""Output verification: catch nodes whose activations are well-formed but wrong, with evidence.

Every reply passes two layers (layer 1 before it is used; layer 2 before the answer it leads to is
returned: routing/deferred.py runs it while the path goes on, `check` runs both at once):

1. A range filter (every hop, no compute): the reply's largest |x| and per-image RMS against the
   activation statistics recorded at evaluation for that position (the `activation_stats` policy of
   the coordinator's own model directories), with a wide margin; and a hard bound of half the wire
   dtype's limit (a residual block adds to its input: past that, the next honest hop overflows). A
   hard violation quarantines the node that sent it (not the next one). A soft violation (an odd
   upload can look odd too) only forces layer 2 for this hop.
2. Spot re-execution: which hops is sampling.py's rule (probation, suspicion: out of range or not
   residual-like (anomaly.py), the answer's decisive hop (decisive.py, asked for by the executor), and
   sampling that trusts a node more the more checks it has passed). They are recomputed by the
   coordinator with a verified copy of the block the node claims to run (same model id and block
   index, sha256 checked, loaded from --model-dir/--family-dir), from the same fp16-rounded input.
   Disagreement beyond the wire dtype's rounding quarantines the node; the evidence goes to /v1/nodes.
   When the coordinator holds no copy of that model (an unlisted model, non-strict mode), the reference
   is the family envelope: the same block index of every member it holds; the reply must lie closer to
   one of them than the members lie to each other (times `envelope_slack`). With `reexecute_on` "peers"
   (or "auto" for a model the coordinator does not hold), the hop goes to a replica that serves the same
   weights hash instead (peer_check.py): a disagreement is decided by the coordinator's copy alone,
   or, without one, leaves the weights contested. Decisive hops always go to the copy when there is one.

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
from ..membership.registry import WeightsKey, weights_key
from .anomaly import ResidualBands, residual
from .peer_check import Ask, PeerVerdict, judge, order_referees
from .ranges import hard_range_problem, position_ranges, range_problem
from .sampling import SUSPICION_HOPS, check_probability

log = logging.getLogger(__name__)

# Relative RMS error allowed between a node's reply and the coordinator's re-execution: a few times the
# rounding of one cast to the wire dtype (the only difference between two honest computations).
# int8 (per-row scales) rounds to 1/254 of each row's peak: about 1% RMS on real activations.
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 4e-2, torch.float32: 1e-4, torch.int8: 3e-2}
MAX_PENDING_TIPS = 1024  # tipped addresses not seen yet, remembered (oldest go first)


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
    decisive: int = 1  # hops of each answer that moved its prediction most, re-executed before it is returned
    contest_s: float = 600.0  # how long weights whose replicas disagreed (no copy here) are routed to by nobody


class Detection(Evidence):
    """A node caught lying, or a disagreement nobody could settle: whose reply, and the evidence."""

    address: str


class VerifyReport(TypedDict):
    """What the verifier did (for operators and the rogue-node bench): its settings, counts, findings."""

    rate: float
    probation_hops: int
    decisive: int
    hops_seen: int
    hops_reexecuted: int
    hops_flagged_by_range: int
    hops_not_residual: int
    hops_checked_as_decisive: int
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
    """A reply that failed verification; `evidence` says what was checked, against what, how far off.
    `convict`: whether its node is to be quarantined on that evidence (Contested: no)."""

    convict = True

    def __init__(self, message: str, evidence: Evidence) -> None:
        super().__init__(message)
        self.evidence = evidence


class Contested(Lie):
    """Replicas disagreed and the coordinator holds no copy: the reply is not used, nobody is convicted,
    and no replica of those weights is routed to for a while (membership/registry.py: contest)."""

    convict = False


@dataclass
class _Seen:
    boot_id: str
    first_hop: float
    hops: int = 0
    passed: int = 0
    suspicion: int = 0  # hops left under closer watch after a suspicious one (sampling.py)
    tipped: int = 0  # hops left that are re-executed whatever the sample: another coordinator convicted it


@dataclass
class Screened:
    """A hop that screening chose for re-execution: what its confirmation needs (Verifier.confirm)."""

    record: NodeRecord
    seen: _Seen
    x: torch.Tensor
    out: torch.Tensor
    position: int
    wire: torch.dtype
    soft: Evidence | None  # the range filter's or the residual check's finding, when it forced the check
    token_mask: torch.Tensor | None
    sent: torch.Tensor | None
    replicas: Callable[[], list[NodeRecord]] | None
    ask: Ask | None
    decisive: bool = False  # drawn as the answer's decisive hop: on our own copy when we hold one
    confirmed: bool = False  # re-executed and passed already (a blocking check): the executor sets it


@dataclass
class VerifyStats:
    hops: int = 0
    reexecuted: int = 0
    reexecute_ms: float = 0.0
    flagged: int = 0
    not_residual: int = 0  # hops whose output did not look like their block's work on their input
    decisive: int = 0  # hops re-executed as their answer's decisive hop
    peer_reexecuted: int = 0  # hops re-executed on a replica
    peer_calls: int = 0
    unresolved: int = 0  # a replica disagreed and we hold no copy: contested, nobody convicted
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
        self._tips: dict[str, int] = {}  # tipped addresses not seen yet: hops to re-execute once they are
        self._rng = random.Random(seed)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")
        self.counters = VerifyStats()
        self.bands = ResidualBands()  # what passed re-execution looked like, per block index (anomaly.py)
        # set by the coordinator: quarantine a referee caught lying (a node other than the one checked)
        self.quarantine_referee: Callable[[str, str, Evidence], None] | None = None
        # set by the coordinator: keep every replica of weights out of routing for a while (contested)
        self.contest: Callable[[WeightsKey, str, float], None] | None = None

    def wants(self, record: NodeRecord) -> bool:
        """Would a hop of `record` be re-executed (on probation, or sampled now)? Relay chains ask this
        before they plan: a hop that is to be checked runs star, where the coordinator sees it."""
        seen = self._seen.get(record.address)
        boot = record.identity.boot_id if record.identity else None
        if seen is None or seen.boot_id != boot:
            return True
        # A tip is only looked at here, never spent: the hop is screened next, and `screen` spends it
        # (spent in both, a tip bought half its hops wherever a caller asks before it screens).
        return seen.passed < self.settings.probation_hops or seen.tipped > 0 or self._sampled(seen)

    def tip(self, address: str, hops: int) -> None:
        """Another coordinator convicted `address` (membership/tips.py): re-execute its next `hops` hops,
        so that a liar is caught here at its next lie, on our own evidence. An honest node just passes
        them; a node not seen yet gets them when it first is."""
        seen = self._seen.get(address)
        if seen is not None:
            seen.tipped = max(seen.tipped, hops)
            return
        self._tips[address] = hops
        while len(self._tips) > MAX_PENDING_TIPS:
            del self._tips[next(iter(self._tips))]

    def _sampled(self, seen: _Seen) -> bool:
        return self._rng.random() < check_probability(self.settings.rate, seen.passed, seen.suspicion > 0)

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
        tipped = seen.tipped > 0  # one of the next TIP_HOPS hops since a tip: spent here, once per hop
        seen.tipped = max(0, seen.tipped - 1)
        hard = hard_range_problem(out, position, wire)
        if hard is not None:
            raise self._convict(record, seen, hard)
        soft = self._suspicious(ident.block, x, out, position)
        seen.suspicion = SUSPICION_HOPS if soft is not None else max(0, seen.suspicion - 1)
        on_probation = seen.passed < self.settings.probation_hops
        if soft is None and not on_probation and not force and not tipped and not self._sampled(seen):
            return None
        return Screened(record, seen, x, out, position, wire, soft, token_mask, sent, replicas, ask)

    def _suspicious(self, block: int, x: torch.Tensor, out: torch.Tensor, position: int) -> Evidence | None:
        """The range filter's finding, else the residual check's: why this hop must be re-executed."""
        soft = range_problem(self.ranges, out, position)
        if soft is not None:
            self.counters.flagged += 1
            return soft
        if x.shape != out.shape:
            return None
        problem = self.bands.problem(block, residual(x, out))
        if problem is None:
            return None
        self.counters.not_residual += 1
        return {"check": "residual", "against": "the hop's own input", "discrepancy": problem, "position": position}

    def decisive(
        self,
        record: NodeRecord,
        x: torch.Tensor,
        out: torch.Tensor,
        position: int,
        wire: torch.dtype,
        sent: torch.Tensor | None,
        replicas: Callable[[], list[NodeRecord]],
        ask: Ask,
    ) -> Screened | None:
        """A hop drawn as its answer's decisive one (decisive.py; screened already when it ran): to be
        re-executed on our own copy when we hold one, whatever `reexecute_on` says. None: a node whose
        identity is unknown (never routed to)."""
        if record.identity is None:
            return None
        self.counters.decisive += 1
        seen = self._seen_for(record)
        return Screened(record, seen, x, out, position, wire, None, None, sent, replicas, ask, decisive=True)

    async def confirm(self, hop: Screened) -> None:
        """Layer 2: re-execute a screened hop; raise Lie with the evidence, or count a pass (probation)."""
        record, seen, position, wire, token_mask = hop.record, hop.seen, hop.position, hop.wire, hop.token_mask
        assert record.identity is not None
        model_id, ask = record.identity.model_id, hop.ask
        on_peers = self._peers_first(model_id) and not (hop.decisive and model_id in self.manifests)
        peers = hop.replicas() if hop.replicas is not None and ask is not None and on_peers else []
        x_sent = codec.as_sent(hop.x, wire) if hop.sent is None else hop.sent  # exactly what the node received
        if peers and ask is not None:
            verdict = await self._on_peers(record, hop.out, position, wire, peers, ask, x_sent, token_mask)
            if verdict is not None:
                self._peer_verdict(record, seen, verdict, position)
                self._passed(hop, learn=bool(verdict.convicted))  # two peers agreeing may be two colluders
                return
        block = record.identity.block
        evidence = await self._reexecute(model_id, block, x_sent, hop.out, position, wire, token_mask)
        if evidence is not None:
            if hop.soft is not None:
                evidence["range_filter"] = hop.soft["discrepancy"]
            raise self._convict(record, seen, evidence)
        self._passed(hop)

    def _passed(self, hop: Screened, learn: bool = True) -> None:
        """A re-execution agreed: one more passed check (trust), and, when it was our own copy that
        agreed, what honest looks like (the residual bands)."""
        hop.seen.passed += 1
        if learn and hop.token_mask is None and hop.x.shape == hop.out.shape and hop.record.identity is not None:
            self.bands.learn(hop.record.identity.block, residual(hop.x, hop.out))

    def _peer_verdict(self, record: NodeRecord, seen: _Seen, verdict: PeerVerdict, position: int) -> None:
        """Convict whom the coordinator's copy caught; a contested disagreement keeps the weights out.
        Returns when the node's reply stands; raises Lie (or Contested) when it does not."""
        if verdict.evidence is None:  # agreed: nothing found against anyone
            return
        evidence: Evidence = {**verdict.evidence, "position": position}
        for liar in verdict.convicted:
            if liar != record.address:
                self._convict_referee(liar, evidence)
        if record.address in verdict.convicted:
            raise self._convict(record, seen, evidence)
        if verdict.contested:
            raise self._contested(record, evidence)

    def stats(self) -> VerifyReport:
        c = self.counters
        return {
            "rate": self.settings.rate,
            "probation_hops": self.settings.probation_hops,
            "decisive": self.settings.decisive,
            "hops_seen": c.hops,
            "hops_reexecuted": c.reexecuted,
            "hops_flagged_by_range": c.flagged,
            "hops_not_residual": c.not_residual,
            "hops_checked_as_decisive": c.decisive,
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
            self.counters.reexecuted += 1
            return ref[0]

        own_copy = coordinator_copy if model_id in self.manifests else None
        referees = order_referees(replicas, self._trusted, self._rng)[:1]
        verdict = await judge(
            record,
            referees,
            counted_ask,
            lambda ref: relative_error(out_wire, codec.as_sent(ref, wire)),
            TOLERANCE[wire],
            own_copy,
        )
        if verdict is not None:
            self.counters.peer_reexecuted += 1
        return verdict

    def _contested(self, record: NodeRecord, evidence: Evidence) -> Contested:
        """Replicas disagreed and we hold no copy: nobody convicted, the weights kept out for a while."""
        assert record.identity is not None
        self.counters.unresolved += 1
        evidence = {**evidence, "at": time.time()}
        self.counters.disagreements.append({"address": record.address, **evidence})
        del self.counters.disagreements[:-100]  # bounded
        ident = record.identity
        reason = (
            f"contested: replicas of {ident.model_id} block {ident.block} disagree and this coordinator holds no "
            f"copy to tell which one lies ({evidence['discrepancy']})"
        )
        log.warning("%s (%s)", reason, record.address)
        if self.contest is not None:
            self.contest(weights_key(ident), reason, self.settings.contest_s)
        return Contested(reason, evidence)

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
            seen = _Seen(record.identity.boot_id, time.monotonic(), tipped=self._tips.pop(record.address, 0))
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
