"""Decode hops checked: a decoder node's reply for a stream's new tokens, held against the coordinator's own
verified copy of the block run over every token that hop has been sent (one causal forward over the whole
sequence is what the node's cache plus the new tokens amount to).

Which hops are checked follows the classifiers' rule (verifier.py): every hop of a node incarnation on
probation, then a `rate` share of the rest. A failed check is a Lie with its evidence; convicting the node
is membership's, and rebuilding the streams it touched is generation's. Where a convicted node's earlier
replies went can be read back (the next hop's stored inputs): `first_bad_row` finds the first token whose
state it falsified, which is where a stream is rebuilt from.

Models the coordinator holds no copy of (non-strict swarms) are not checked here: there is no reference.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from layerswarm.models.checkpoint import Manifest, load_block, read_lm_manifest
from layerswarm.models.lm.config import LMConfig
from layerswarm.models.lm.model import DecoderBlock
from layerswarm.wire import codec

from ..membership.records import Evidence, NodeRecord
from .verifier import TOLERANCE, Detection, VerifySettings, VerifyStats, relative_error

log = logging.getLogger(__name__)


@dataclass
class _Seen:
    boot_id: str
    first_hop: float
    hops: int = 0
    passed: int = 0


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """(1, T, D) and (1, T, D) -> (T,) relative RMS error of each token's state."""
    diff = (out - ref).pow(2).mean(-1).sqrt()[0]
    return diff / ref.pow(2).mean(-1).sqrt()[0].clamp_min(1e-6)


class DecodeVerifier:
    def __init__(self, model_dirs: list[Path], settings: VerifySettings, seed: int | None = None) -> None:
        self.settings = settings
        self.manifests: dict[str, tuple[Path, Manifest[LMConfig]]] = {}
        for model_dir in model_dirs:
            manifest = read_lm_manifest(model_dir)
            self.manifests[manifest.model_id] = (model_dir, manifest)
        self.counters = VerifyStats()
        self._blocks: dict[tuple[str, int], DecoderBlock] = {}
        self._seen: dict[str, _Seen] = {}
        self._rng = random.Random(seed)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify-decode")

    def wants(self, record: NodeRecord) -> bool:
        """Count one hop of `record`; True when it is to be re-executed (probation, or sampled now) and
        the coordinator holds the model it claims to run."""
        ident = record.identity
        if ident is None:
            return False
        seen = self._seen_for(record)
        seen.hops += 1
        self.counters.hops += 1
        if ident.model_id not in self.manifests:
            return False
        return seen.passed < self.settings.probation_hops or self._rng.random() < self.settings.rate

    async def check(
        self, record: NodeRecord, inputs: torch.Tensor, out: torch.Tensor, wire: torch.dtype, position: int
    ) -> Evidence | None:
        """`out` (1, T, D): the node's states for the last T of `inputs` (1, L, D), everything it was sent
        for this stream, as it decoded it. None when they agree with the reference; else the evidence
        (the caller convicts with `convict`)."""
        assert record.identity is not None
        model_id, block = record.identity.model_id, record.identity.block
        started = time.perf_counter()
        ref = (await self.reference(model_id, block, inputs))[:, -out.shape[1] :]
        self.counters.reexecuted += 1
        self.counters.reexecute_ms += (time.perf_counter() - started) * 1e3
        err, tol = relative_error(codec.as_sent(out, wire), codec.as_sent(ref, wire)), TOLERANCE[wire]
        if err <= tol:
            self._seen_for(record).passed += 1
            return None
        return {
            "check": "re-execution",
            "against": f"the coordinator's verified copy of {model_id} block {block} over the stream's tokens",
            "discrepancy": f"relative RMS error {err:.4g}",
            "tolerance": tol,
            "position": position,
        }

    async def first_bad_row(
        self, model_id: str, block: int, inputs: torch.Tensor, outputs: torch.Tensor, since: int, wire: torch.dtype
    ) -> int | None:
        """The first token (from `since` on) whose state in `outputs` (1, L, D: what the node's replies
        became downstream) departs from the reference over `inputs` (1, L, D); None when none does or
        the model is not held."""
        if model_id not in self.manifests or outputs.shape[1] <= since:
            return None
        ref = await self.reference(model_id, block, inputs)
        errors = row_errors(codec.as_sent(outputs[:, since:], wire), codec.as_sent(ref[:, since:], wire))
        bad = torch.nonzero(errors > TOLERANCE[wire])
        return since + int(bad[0, 0]) if bad.numel() else None

    async def reference(self, model_id: str, block: int, inputs: torch.Tensor) -> torch.Tensor:
        """The verified block over (1, L, D) states in one causal forward (no cache): (1, L, D)."""

        def compute() -> torch.Tensor:
            with torch.inference_mode():
                return self._block(model_id, block)(inputs)

        return await asyncio.get_running_loop().run_in_executor(self._pool, compute)

    def convict(self, record: NodeRecord, evidence: Evidence) -> Evidence:
        """The evidence as a conviction records it (when and after how many hops), counted."""
        seen = self._seen_for(record)
        evidence = {
            **evidence,
            "hops_before_detection": seen.hops,
            "seconds_since_first_hop": round(time.monotonic() - seen.first_hop, 3),
            "at": time.time(),
        }
        detection: Detection = {"address": record.address, **evidence}
        self.counters.convicted += 1
        self.counters.detections.append(detection)
        del self.counters.detections[:-100]  # bounded
        log.warning("quarantining %s on evidence: %s", record.address, evidence)
        return evidence

    def forget(self, address: str) -> None:
        self._seen.pop(address, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _block(self, model_id: str, index: int) -> DecoderBlock:
        key = (model_id, index)
        if key not in self._blocks:
            model_dir, manifest = self.manifests[model_id]
            self._blocks[key] = load_block(model_dir, index, manifest)  # sha256 checked on load
        return self._blocks[key]

    def _seen_for(self, record: NodeRecord) -> _Seen:
        assert record.identity is not None
        seen = self._seen.get(record.address)
        if seen is None or seen.boot_id != record.identity.boot_id:  # a new incarnation starts on probation
            seen = _Seen(record.identity.boot_id, time.monotonic())
            self._seen[record.address] = seen
        return seen
