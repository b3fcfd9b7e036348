"""What makes one relay trace entry believable, checked the same way by the node it is passed back to
and by the coordinator (docs/relay.md, "Blame").

An entry comes back along the chain: node k writes and signs it, node k - 1 receives it (with the
entries after it) and passes it on, and so on to the coordinator. Every node checks the entry of the
node after it before passing anything back; a bad one makes it hand back instead, naming that node.
So a bad entry that reaches the coordinator was passed on by the node before it, who either wrote the
problem (its own output digest, the rest it vouched for) or let it through unchecked: that node, and
only that node, is blamed. Without these checks a node could alter a later node's entry and have two
honest nodes blamed for it, or sign garbage and take its honest predecessor down with it.
"""

from __future__ import annotations

from .trace_sign import hop_signed_by
from .v1 import block_pb2 as pb

MAX_TRACE_MS = 3.6e6  # a reported time past an hour is a lie or a bug


def entry_problem(
    entry: pb.HopTrace,
    step: pb.RelayStep,
    rest_sha256: str,
    input_sha256: str,
    request_id: str,
    plan_mac: str,
) -> str | None:
    """Why `entry` cannot be the trace of `step`, or None. `rest_sha256`: the digest of the entries that
    came back after it (trace_sign.rest_digest); `input_sha256`: the digest of what its node was sent
    (the previous output). Signature and rest are checked only where the step names the node's trace
    key (nodes from before keys report none)."""
    if (entry.node, entry.block, entry.position) != (step.address, step.block, step.position):
        return "it is not the planned step"
    times = (entry.compute_ms, entry.rtt_ms)
    if not (all(0 <= t < MAX_TRACE_MS for t in times) and abs(entry.send_ms) < MAX_TRACE_MS):
        return "it has impossible times"  # NaN and infinity fail too: never let them into latency estimates
    if entry.input_sha256 != input_sha256:
        return "its input digest is not the digest of what its node was sent"
    if not step.trace_key:
        return None
    if not hop_signed_by(step.trace_key, entry, request_id, plan_mac):
        return "it is not signed by its node"
    if entry.rest_sha256 != rest_sha256:
        return "the entries after it are not the ones its node passed back"
    return None
