"""Relay trace entries signed by their node (wire/trace_sign.py): any change to any field, another chain
or another node's key fails the check; malformed keys and signatures are refused, never raised on."""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor

from layerswarm.bench.trace_cost import sample_hop
from layerswarm.wire.trace_sign import TraceSigner, hop_message, hop_signed_by
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
