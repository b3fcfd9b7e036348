"""Relay trace entries signed by their node (wire/trace_sign.py): any change to any field, another chain
or another node's key fails the check; malformed keys and signatures are refused, never raised on."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from google.protobuf.descriptor import FieldDescriptor

from layerswarm.bench.trace_cost import chain_check, sample_hop, signed_chain, trace_signature_cost
from layerswarm.wire.relay_plan import digest, plan_mac
from layerswarm.wire.trace_sign import TraceSigner, hop_message, hop_signed_by, rest_digest, rest_digests
from layerswarm.wire.v1 import block_pb2 as pb

RID, MAC = "req-1-c1", "a" * 64


def signed_hop(signer: TraceSigner) -> pb.HopTrace:
    hop = sample_hop()
    signer.sign(hop, RID, MAC)
    return hop


def test_a_signed_entry_checks_with_its_nodes_key_only() -> None:
    signer, other = TraceSigner(), TraceSigner()
    hop = signed_hop(signer)
    assert hop_signed_by(signer.public, hop, RID, MAC)
    assert not hop_signed_by(other.public, hop, RID, MAC)  # another node cannot have written it
    assert not hop_signed_by(signer.public, hop, "req-2-c1", MAC)  # nor can it be moved to another chain
    assert not hop_signed_by(signer.public, hop, RID, "b" * 64)


def _changed(hop: pb.HopTrace, field: FieldDescriptor) -> pb.HopTrace:
    copy = pb.HopTrace()
    copy.CopyFrom(hop)
    value = getattr(hop, field.name)
    if field.type == FieldDescriptor.TYPE_STRING:
        setattr(copy, field.name, value + "x")
    elif field.type == FieldDescriptor.TYPE_DOUBLE:
        setattr(copy, field.name, value * 2 + 1e-9)  # also a change in the last bits only
    else:
        setattr(copy, field.name, value + 1)
    return copy


@pytest.mark.parametrize("field", [f for f in pb.HopTrace.DESCRIPTOR.fields if f.name != "signature"], ids=str)
def test_changing_any_field_of_an_entry_breaks_its_signature(field: FieldDescriptor) -> None:
    """Also guards the message: a field added to HopTrace but not to hop_message fails here."""
    signer = TraceSigner()
    hop = signed_hop(signer)
    forged = _changed(hop, field)
    assert hop_message(forged, RID, MAC) != hop_message(hop, RID, MAC)
    assert not hop_signed_by(signer.public, forged, RID, MAC)


@pytest.mark.parametrize(("key", "signature"), [(b"", None), (b"\x00" * 31, None), (None, b""), (None, b"\x00" * 64)])
def test_malformed_keys_and_signatures_are_refused(key: bytes | None, signature: bytes | None) -> None:
    signer = TraceSigner()
    hop = signed_hop(signer)
    if signature is not None:
        hop.signature = signature
    assert not hop_signed_by(signer.public if key is None else key, hop, RID, MAC)


def test_the_message_cannot_be_shifted_between_fields() -> None:
    """Length-prefixed: moving characters from one field to the next changes the message."""
    hop = pb.HopTrace(node="10.0.0.2:50051")
    assert hop_message(hop, "req-1", "c" + MAC) != hop_message(hop, "req-1c", MAC)


def _signed_chain(signers: list[TraceSigner]) -> tuple[list[pb.RelayStep], list[pb.HopTrace]]:
    return signed_chain(signers, RID, MAC)


def _problems(steps: list[pb.RelayStep], trace: list[pb.HopTrace]) -> list[str | None]:
    return chain_check(steps, trace, RID, MAC)


def test_an_honest_trace_checks_entry_by_entry() -> None:
    steps, trace = _signed_chain([TraceSigner() for _ in range(3)])
    assert _problems(steps, trace) == [None, None, None]


def test_each_lie_in_a_trace_is_found_at_the_entry_of_the_node_to_blame() -> None:
    """wire/trace_check.py: the first bad entry is on the node that passed it on (or wrote it)."""
    signers = [TraceSigner() for _ in range(3)]
    steps, trace = _signed_chain(signers)
    trace[1].signature = bytes(64)  # node 1 signs garbage and node 0 passes it on unchecked, vouching for it
    trace[0].rest_sha256 = rest_digest(trace[1:], RID, MAC)
    signers[0].sign(trace[0], RID, MAC)
    assert _problems(steps, trace) == [None, "it is not signed by its node", None]  # on node 0, who passed it

    steps, trace = _signed_chain([TraceSigner() for _ in range(3)])
    trace[2].send_ms = 5000.0  # node 0 rewrites node 2's entry on the way back
    assert _problems(steps, trace) == [
        "the entries after it are not the ones its node passed back",
        "the entries after it are not the ones its node passed back",
        "it is not signed by its node",
    ]

    steps, trace = _signed_chain([TraceSigner() for _ in range(3)])
    trace[1].input_sha256 = digest(b"something else")  # node 1 claims another input than node 0's output
    assert _problems(steps, trace)[1] == "its input digest is not the digest of what its node was sent"

    steps, trace = _signed_chain([TraceSigner() for _ in range(2)])
    trace[1].block = 7
    assert _problems(steps, trace)[1] == "it is not the planned step"


def test_a_step_without_a_key_is_checked_for_all_but_its_signature() -> None:
    """Nodes from before trace keys: their entries come unsigned and vouch for nothing."""
    steps, trace = _signed_chain([TraceSigner() for _ in range(2)])
    steps[1].trace_key = b""
    trace[1].signature, trace[1].rest_sha256 = b"", ""
    assert _problems(steps, trace)[1] is None
    trace[1].compute_ms = float("nan")
    assert _problems(steps, trace)[1] == "it has impossible times"


def test_the_plan_mac_covers_each_steps_trace_key_and_where_the_result_goes() -> None:
    """A node before a step checks that step's entry with the key the chain names: no node on the way
    may swap it, nor divert the result (kept for Collect, or sent back along the chain)."""
    key = b"k" * 32
    step = pb.RelayStep(address="10.0.0.2:50051", position=0, block=0)
    keyed = pb.RelayStep(address="10.0.0.2:50051", position=0, block=0, trace_key=TraceSigner().public)
    assert plan_mac(key, RID, 1, [step], collect=True) != plan_mac(key, RID, 1, [keyed], collect=True)
    swapped = pb.RelayStep(address="10.0.0.2:50051", position=0, block=0, trace_key=TraceSigner().public)
    assert plan_mac(key, RID, 1, [keyed], collect=True) != plan_mac(key, RID, 1, [swapped], collect=True)
    assert plan_mac(key, RID, 1, [keyed], collect=True) != plan_mac(key, RID, 1, [keyed], collect=False)
    text = f"relay|{RID}|1|collect|10.0.0.2:50051,0,0"
    assert plan_mac(key, RID, 1, [step], collect=True) == hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def test_the_cost_bench_runs_on_an_honest_chain() -> None:
    """bench/trace_cost.py raises if an honest chain ever failed its checks (so its timings are of checks
    that pass, as on a real chain's way back)."""
    figures = trace_signature_cost(reps=3, chain_nodes=4)
    assert figures["chain_nodes"] == 4 and figures["coordinator_chain_check_us"] > figures["check_us"] > 0


def test_every_suffix_digest_at_once_is_each_rest_digest() -> None:
    """The coordinator's one-pass digests (rest_digests) must be exactly what each node signs (rest_digest)."""
    _, trace = _signed_chain([TraceSigner() for _ in range(4)])
    assert rest_digests(trace, RID, MAC) == [rest_digest(trace[k:], RID, MAC) for k in range(len(trace) + 1)]
    assert len(set(rest_digests(trace, RID, MAC))) == len(trace) + 1  # every suffix differs, the empty one too
