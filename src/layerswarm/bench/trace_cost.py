"""What signing and checking relay trace entries costs (wire/trace_sign.py, wire/trace_check.py) on this
machine: one node's signature on its entry and a check of it; a node's work on a chain's way back (the
check of the entry after its own, its rest digest, its signature); the coordinator's check of a whole
chain's trace. The edge LAN bench reports it beside the relay figures that include it; alone:

    python -m layerswarm.bench.trace_cost [--json PATH]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from layerswarm.wire.relay_plan import digest
from layerswarm.wire.trace_check import entry_problem
from layerswarm.wire.trace_sign import TraceSigner, hop_signed_by, rest_digest, rest_digests
from layerswarm.wire.v1 import block_pb2 as pb

from . import emit_report
from .fixtures import median_ms
from .machine import environment


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


def signed_chain(
    signers: list[TraceSigner], request_id: str, plan_mac: str
) -> tuple[list[pb.RelayStep], list[pb.HopTrace]]:
    """A chain of len(signers) steps and its trace as honest nodes write it: each entry's input is the
    previous output (the first: digest(b"in")), each node signs over the entries after it, last first."""
    steps = [
        pb.RelayStep(address=f"10.0.0.{k}:5005{k}", position=k, block=k, trace_key=s.public)
        for k, s in enumerate(signers)
    ]
    trace = [
        pb.HopTrace(node=st.address, block=st.block, position=st.position, compute_ms=40.0, send_ms=2.5, rtt_ms=0.3)
        for st in steps
    ]
    for k, entry in enumerate(trace):
        entry.input_sha256 = digest(b"in") if k == 0 else trace[k - 1].output_sha256
        entry.output_sha256 = digest(f"out-{k}".encode())
        entry.sent_bytes = 302_592
    for k in reversed(range(len(trace))):
        trace[k].rest_sha256 = rest_digest(trace[k + 1 :], request_id, plan_mac)
        signers[k].sign(trace[k], request_id, plan_mac)
    return steps, trace


def chain_check(
    steps: list[pb.RelayStep], trace: list[pb.HopTrace], request_id: str, plan_mac: str
) -> list[str | None]:
    """Every entry's problem as the coordinator sees the trace (None: believable)."""
    came_in = [digest(b"in"), *(t.output_sha256 for t in trace[:-1])]
    rests = rest_digests(trace, request_id, plan_mac)
    return [entry_problem(t, steps[k], rests[k + 1], came_in[k], request_id, plan_mac) for k, t in enumerate(trace)]


def trace_signature_cost(reps: int = 200, chain_nodes: int = 12) -> dict[str, Any]:
    """Median microseconds: to sign one entry (a node) and to check it; the first node's work on the
    way back of a `chain_nodes` chain (check the next entry, digest the rest, sign: the most entries);
    the coordinator's check of the whole trace."""
    signer = TraceSigner()
    hop = sample_hop()
    rid, mac = "bench-request-c1", "m" * 64
    sign, check, first_node, whole = [], [], [], []
    signers = [TraceSigner() for _ in range(chain_nodes)]
    steps, trace = signed_chain(signers, rid, mac)
    for _ in range(reps):
        started = time.perf_counter()
        signer.sign(hop, rid, mac)
        signed = time.perf_counter()
        if not hop_signed_by(signer.public, hop, rid, mac):
            raise RuntimeError("a freshly signed trace entry did not check")
        checked = time.perf_counter()
        rests = rest_digests(trace[1:], rid, mac)  # as node/relay.py: one pass for its check and its own rest
        if entry_problem(trace[1], steps[1], rests[1], trace[0].output_sha256, rid, mac) is not None:
            raise RuntimeError("an honest trace entry did not check")
        trace[0].rest_sha256 = rests[0]
        signers[0].sign(trace[0], rid, mac)
        passed = time.perf_counter()
        if any(chain_check(steps, trace, rid, mac)):
            raise RuntimeError("an honest trace did not check")
        sign.append(signed - started)
        check.append(checked - signed)
        first_node.append(passed - checked)
        whole.append(time.perf_counter() - passed)
    return {
        "reps": reps,
        "sign_us": round(median_ms(sign) * 1e3, 1),
        "check_us": round(median_ms(check) * 1e3, 1),
        "chain_nodes": chain_nodes,
        "first_node_way_back_us": round(median_ms(first_node) * 1e3, 1),
        "coordinator_chain_check_us": round(median_ms(whole) * 1e3, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"environment": environment()}
    report.update(trace_signature_cost())
    return emit_report(report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
