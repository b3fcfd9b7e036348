"""What the coordinator checks in a relay chain's trace before it believes it (docs/relay.md, "Trust"),
and the link figures it takes from one: pure, on the trace and the chain as sent."""

from __future__ import annotations

from typing import NamedTuple

from layerswarm.wire.relay_plan import digest
from layerswarm.wire.trace_check import entry_problem
from layerswarm.wire.trace_sign import rest_digests
from layerswarm.wire.v1 import block_pb2 as pb

from ..membership.linkmap import LinkMap
from ..membership.records import NodeRecord
from ..routing.planner import Step


def observe_relay_link(links: LinkMap, sender: pb.HopTrace, receiver: pb.HopTrace) -> None:
    """send_ms spans the activation's way there and the acknowledgement's way back: with the sender's
    probed RTT (checked in range with the trace), the way back is taken off here and the way there's
    fixed half by the LinkMap, leaving the per-byte part."""
    if sender.rtt_ms > 0:
        links.observe_rtt(sender.node, receiver.node, sender.rtt_ms)
    links.observe(sender.node, receiver.node, sender.sent_bytes, max(sender.send_ms, 0.0) - sender.rtt_ms / 2)


class Broken(NamedTuple):
    """Where a chain's trace or result stopped being believable: between steps `step - 1` and `step`;
    `only`: the one step whose node is to blame, where the trace proves it (wire/trace_check.py)."""

    step: int
    reason: str
    only: int | None = None


def trace_problem(
    trace: list[pb.HopTrace], segment: list[tuple[Step, NodeRecord]], sent: pb.RelayRequest, handed_back: bool = False
) -> Broken | None:
    """Why the trace is not one of this chain (steps, positions, times, digests, signatures), or None."""
    if not trace or len(trace) > len(segment):
        return Broken(len(trace), f"trace of {len(trace)} hops for a chain of {len(segment)}")
    if len(trace) < len(segment) and not handed_back:
        # Never wait on Collect for it: the last node never got the chain. Every node checks the final
        # event it passes back (node/relay.py: final_problem), so a short one reaching us is the first
        # node's doing.
        return Broken(0, f"trace of {len(trace)} hops for a chain of {len(segment)}, without a hand-back")
    # With every node's trace key known, every node checked the entry after its own before passing it
    # back (wire/trace_check.py): so the first bad entry k was passed on unchecked by node k-1 (node 0
    # for entry 0), which is blamed alone. Every chain has every key: _segment chains keyed nodes only.
    rid, mac = sent.forward.request_id, sent.plan_mac
    rests = rest_digests(trace, rid, mac)  # rests[k + 1]: what entry k's node vouched for
    for k, t in enumerate(trace):
        came_in = digest(sent.forward.activations.data) if k == 0 else trace[k - 1].output_sha256
        problem = entry_problem(t, sent.chain[k], rests[k + 1], came_in, rid, mac)
        if problem is not None:
            return Broken(k, f"trace step {k} ({t.node}): {problem}", max(k - 1, 0))
    return None
