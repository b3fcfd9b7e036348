"""The wire: one codec for every tensor, strict validation, and stubs in step with the .proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layerswarm.wire import codec
from layerswarm.wire.discovery import Advert
from layerswarm.wire.v1 import block_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
SPEC = codec.TensorSpec(shape=(None, 5, 8), max_batch=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    x = torch.randn(3, 5, 8).to(dtype)
    msg = codec.encode(x)
    assert len(msg.data) == x.numel() * x.element_size()  # raw bytes, not repeated floats
    y = codec.decode(pb.Tensor.FromString(msg.SerializeToString()), SPEC)
    assert y.dtype == dtype and torch.equal(x, y)


def test_encode_casts_for_the_wire() -> None:
    x = torch.randn(2, 5, 8)
    y = codec.decode(codec.encode(x, torch.float16), SPEC)
    assert y.dtype == torch.float16 and torch.allclose(x, y.float(), atol=1e-2)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m.shape.__setitem__(1, 6), "dim 1 is 6"),
        (lambda m: m.shape.append(1), "rank-3"),
        (lambda m: setattr(m, "data", m.data[:-2]), "needs"),
        (lambda m: setattr(m, "dtype", 0), "unsupported wire dtype"),
        (lambda m: setattr(m, "dtype", 99), "unsupported wire dtype"),
        (lambda m: m.shape.__setitem__(0, -1), "negative"),
    ],
)
def test_malformed_tensors_are_refused(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    msg = codec.encode(torch.zeros(2, 5, 8))
    mutate(msg)
    with pytest.raises(codec.TensorError, match=message):
        codec.decode(msg, SPEC)


def test_int8_rows_carry_a_quarter_of_the_bytes_within_rounding() -> None:
    x = torch.randn(2, 197, 768) * torch.rand(2, 197, 1) * 10  # rows of very different ranges
    msg = codec.encode(x, torch.int8)
    assert len(msg.data) == x.numel() and len(msg.scales) == 2 * 197 * 4  # 1 byte a value, 4 a token
    y = codec.decode(pb.Tensor.FromString(msg.SerializeToString()))
    assert y.dtype == torch.float32 and y.shape == x.shape
    peak = x.abs().amax(-1, keepdim=True)
    assert bool(((y - x).abs() <= peak / 254 + 1e-6).all())  # half a step of each row's own scale
    assert torch.equal(codec.as_sent(x, torch.int8), y)
    assert torch.equal(codec.decode(codec.encode(torch.zeros(1, 5, 8), torch.int8), SPEC), torch.zeros(1, 5, 8))


@pytest.mark.parametrize(
    ("scales", "message"),
    [
        (b"", "needs 5 float32 scales"),
        (b"\x00" * 24, "needs 5 float32 scales"),
        (b"\x00" * 20, "finite and positive"),
        (b"\x00\x00\xc0\x7f" * 5, "finite and positive"),
    ],
)
def test_malformed_int8_is_refused(scales: bytes, message: str) -> None:
    msg = codec.encode(torch.randn(1, 5, 8), torch.int8)
    msg.scales = scales
    with pytest.raises(codec.TensorError, match=message):
        codec.decode(msg, SPEC)
    fp16 = codec.encode(torch.randn(1, 5, 8), torch.float16)
    fp16.scales = b"\x00\x00\x80\x3f" * 5
    with pytest.raises(codec.TensorError, match="only sent with int8"):
        codec.decode(fp16, SPEC)


def test_limits_and_non_finite_values() -> None:
    with pytest.raises(codec.TensorError, match="batch size 5"):
        codec.decode(codec.encode(torch.zeros(5, 5, 8)), SPEC)
    bad = torch.zeros(1, 5, 8)
    bad[0, 2, 3] = float("inf")
    with pytest.raises(codec.TensorError, match="NaN or Inf"):
        codec.decode(codec.encode(bad), SPEC)
    small = codec.TensorSpec(shape=(None, 5, 8), max_bytes=100)
    with pytest.raises(codec.TensorError, match="limit"):
        codec.decode(codec.encode(torch.zeros(1, 5, 8)), small)
    with pytest.raises(codec.TensorError, match="cannot travel"):
        codec.encode(torch.zeros(2, dtype=torch.int64))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=12),
    st.binary(max_size=512),
    st.integers(-5, 10),
    st.binary(max_size=64),
)
def test_decode_never_crashes_on_garbage(shape: list[int], data: bytes, dtype: int, scales: bytes) -> None:
    msg = pb.Tensor(dtype=dtype if dtype >= 0 else 0, shape=[s - 2**31 for s in shape], data=data, scales=scales)
    try:
        out = codec.decode(msg, SPEC)
    except codec.TensorError:
        return
    assert out.shape[1:] == (5, 8) and bool(torch.isfinite(out).all())


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.sampled_from(["fp32", "fp16", "bf16"]))
def test_round_trip_property(batch: int, dtype_name: str) -> None:
    x = torch.randn(batch, 5, 8).to(codec.dtype_by_name(dtype_name))
    assert torch.equal(codec.decode(codec.encode(x), SPEC), x)


def test_txt_record_round_trip_and_errors() -> None:
    advert = Advert(
        family="fam-1", model="mdl-2", block=3, variant="layershuffle", proto=1, boot="b" * 32, sha="c" * 16
    )
    txt = {k.encode(): v.encode() for k, v in advert.to_txt().items()}
    assert Advert.from_txt(txt) == advert  # type: ignore[arg-type]
    forged = {**txt, b"family": b"fam-1\nnode 10.0.0.7:50051: healthy -> ejected (forged)"}
    with pytest.raises(ValueError, match="control characters in family"):  # it would be logged as is
        Advert.from_txt(forged)  # type: ignore[arg-type]
    del txt[b"block"]
    with pytest.raises(ValueError, match="lacks block"):
        Advert.from_txt(txt)  # type: ignore[arg-type]


def test_generated_stubs_match_the_proto() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_service_name_written_once_is_the_protos() -> None:
    """Health checks, call signing and the coordinator-only interceptor all name the gRPC service by
    wire.discovery's constant: it must be the name the generated stubs serve under."""
    from layerswarm.wire.discovery import HEALTH_SERVICE, METHOD_PREFIX
    from layerswarm.wire.v1 import block_pb2

    service = block_pb2.DESCRIPTOR.services_by_name["BlockNode"]
    assert service.full_name == HEALTH_SERVICE
    assert f"/{service.full_name}/" == METHOD_PREFIX


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), float("-inf")])
def test_any_non_finite_value_anywhere_is_refused(dtype: torch.dtype, bad_value: float) -> None:
    """The finiteness check is one aminmax pass: it must still see a lone NaN or Inf at any position
    (vectorised heads, tails, the middle) of a ViT-B-sized activation, and in an int8 tensor's scales."""
    spec = codec.TensorSpec(shape=(None, 197, 768))
    x = torch.randn(1, 197, 768).to(dtype)
    for index in (0, 15, 197 * 768 // 2 + 3, 197 * 768 - 1):
        bad = x.clone()
        bad.view(-1)[index] = bad_value
        with pytest.raises(codec.TensorError, match="NaN or Inf"):
            codec.decode(codec.encode(bad), spec)
    assert torch.equal(codec.decode(codec.encode(x), spec), x)  # and a finite one passes, bit-exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_encode_sent_is_encode_and_what_the_receiver_decodes(dtype: torch.dtype) -> None:
    t = torch.randn(3, 7, 16) * 10
    msg, sent = codec.encode_sent(t, dtype)
    assert msg == codec.encode(t, dtype)
    assert sent.dtype == torch.float32 and torch.equal(sent, codec.decode(msg).float())
    assert torch.equal(sent, codec.as_sent(t, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_peak_abs_is_the_largest_magnitude_either_sign(dtype: torch.dtype) -> None:
    for sign in (1, -1):
        x = (torch.randn(2, 197, 768) * 20).to(dtype)
        x.view(-1)[1234] = sign * 120  # the peak, negative in one case: |min| must count
        assert codec.peak_abs(x) == float(x.abs().max()) == 120


def test_large_buffers_are_kept_on_glibc_linux() -> None:
    """wire/memory.py: applied where glibc is (this machine, the images), a no-op elsewhere."""
    import platform

    from layerswarm.wire.memory import keep_large_buffers

    expected = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert keep_large_buffers() is expected
