"""What signing relay trace entries costs (wire/trace_sign.py): one node's signature on its entry and
the coordinator's check of it, per relayed hop, on this machine (the edge LAN bench reports it beside
the relay figures that include it)."""

from __future__ import annotations

import time
from typing import Any

from layerswarm.wire.trace_sign import TraceSigner, hop_signed_by
from layerswarm.wire.v1 import block_pb2 as pb

from .fixtures import median_ms


def sample_hop() -> pb.HopTrace:
    """A relayed ViT-B/16 hop's trace entry (fp16 activation), every field set, unsigned."""
    return pb.HopTrace(
        node="10.0.0.2:50051",
        block=3,
        position=1,
        compute_ms=41.0,
        send_ms=3.2,
        sent_bytes=197 * 768 * 2,
        input_sha256="11" * 32,
        output_sha256="22" * 32,
        rtt_ms=0.3,
        rest_sha256="33" * 32,
    )


def trace_signature_cost(reps: int = 200) -> dict[str, Any]:
    """Median microseconds to sign one entry (a node) and to check it (the coordinator)."""
    signer = TraceSigner()
    hop = sample_hop()
    rid, mac = "bench-request-c1", "m" * 64
    sign, check = [], []
    for _ in range(reps):
        started = time.perf_counter()
        signer.sign(hop, rid, mac)
        signed = time.perf_counter()
        if not hop_signed_by(signer.public, hop, rid, mac):
            raise RuntimeError("a freshly signed trace entry did not check")
        sign.append(signed - started)
        check.append(time.perf_counter() - signed)
    return {"reps": reps, "sign_us": round(median_ms(sign) * 1e3, 1), "check_us": round(median_ms(check) * 1e3, 1)}
