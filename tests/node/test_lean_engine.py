"""The numpy engine (node/engines/numpy_engine.py, models/lean/) against the torch blocks it replaces, and a
node that serves without torch at all.

Tolerance, fp32: every output within LEAN_TOL (absolute) of the torch block's on activations of unit
scale; measured here at about 1e-6 (the two compute the same float32 math in different orders).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from layerswarm.harness.procs import node_cmd, spawn, stop_all
from layerswarm.models.checkpoint import Lineage, load_block, read_any_manifest, save_model
from layerswarm.models.lean.ops import erf
from layerswarm.models.text.tokens import run_active
from layerswarm.models.vit import ViT
from layerswarm.node.engines import EngineError, choose_engine, load_engine, serves_decoder
from layerswarm.node.engines.numpy_engine import NumpyEngine
from layerswarm.wire import arrays, codec
from layerswarm.wire.auth import NONCE_KEY, CallSigner, info_identity
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from ..conftest import make_model_dir, tiny_config
from ..lm_nodes import make_lm_dir

LEAN_TOL = 2e-5
ROOT = Path(__file__).resolve().parents[2]


def numpy_engine(model_dir: Path, block: int) -> NumpyEngine:
    engine = load_engine(model_dir, block, read_any_manifest(model_dir), "numpy", "cpu")
    assert isinstance(engine, NumpyEngine)
    return engine


def max_diff(a: np.ndarray, b: torch.Tensor) -> float:
    assert tuple(a.shape) == tuple(b.shape), (a.shape, b.shape)
    return float(np.abs(a - b.numpy()).max())


def test_erf_is_within_float32_rounding_of_the_exact_one() -> None:
    x = np.linspace(-6, 6, 20001, dtype=np.float32)
    exact = np.array([math.erf(float(v)) for v in x])
    assert np.abs(erf(x) - exact).max() < 5e-7


@pytest.mark.parametrize("variant", ["layershuffle", "layershuffle-position", "layershuffle-predict", "baseline"])
def test_vit_block_matches_torch_at_every_position(tmp_path: Path, variant: str) -> None:
    model_dir = make_model_dir(tmp_path / variant, variant=variant, seed=3)
    torch.manual_seed(0)
    x = torch.randn(3, 5, 32)
    for index in range(3):
        engine, block = numpy_engine(model_dir, index), load_block(model_dir, index)
        for position in range(3):
            with torch.inference_mode():
                want = block(x, position)
            assert max_diff(engine.forward(x.numpy(), position), want) < LEAN_TOL


def test_text_block_with_token_masks_matches_torch(tmp_path: Path) -> None:
    """The text family's hop with a token mask: active tokens computed, frozen ones read, padding neither."""
    torch.manual_seed(1)
    cfg = tiny_config("layershuffle-position", kind="text", vocab_size=50, max_tokens=12)
    model_dir = tmp_path / "text"
    (model_dir).mkdir()
    (model_dir / "tokenizer.json").write_text(json.dumps({"note": "placeholder"}))
    save_model(ViT(cfg), model_dir, Lineage(source="scratch"))
    engine, block = numpy_engine(model_dir, 1), load_block(model_dir, 1)
    x = torch.randn(3, 12, 32)
    mask = torch.tensor(
        [[2] * 12, [2, 1, 2, 1, 1, 2, 0, 0, 0, 0, 0, 0], [1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.float32
    )
    want = run_active(block, x, 2, mask)
    assert max_diff(engine.forward_tokens(x.numpy(), 2, mask.numpy()), want) < LEAN_TOL
    frozen = torch.tensor([[1] * 12, [1] * 6 + [0] * 6, [1] * 12], dtype=torch.float32)  # nothing active
    assert engine.forward_tokens(x.numpy(), 0, frozen.numpy()).shape == (0, 32)


def test_decoder_block_matches_torch_full_forward_steps_fill_and_rollback(tmp_path: Path) -> None:
    """Prefill, decode steps, a CALM fill, a speculative rollback and batched rows of different lengths:
    the numpy block and its caches against the torch block and its."""
    make_lm_dir(tmp_path / "lm", seed=4, heads=4, kv_heads=2, qkv_bias=True)
    engine, block = numpy_engine(tmp_path / "lm", 1), load_block(tmp_path / "lm", 1, read_any_manifest(tmp_path / "lm"))
    torch.manual_seed(2)
    prompt = torch.randn(1, 7, 32)
    with torch.inference_mode():
        assert max_diff(engine.forward(prompt.numpy(), 0), block(prompt)) < LEAN_TOL  # no cache: causal
        mine, theirs = engine.new_cache(), block.new_cache()
        worst = max_diff(engine.decode(prompt.numpy(), [mine]), block(prompt, caches=[theirs]))
        for _ in range(5):
            step = torch.randn(1, 1, 32)
            worst = max(worst, max_diff(engine.decode(step.numpy(), [mine]), block(step, caches=[theirs])))
        fill = torch.randn(1, 3, 32)  # CALM: keys and values only
        engine.append_kv(fill.numpy(), [mine])
        block.append_kv(fill, [theirs])
        assert mine.length == theirs.length == 15
        mine.truncate(10)  # a speculative verify rejected drafts: roll back, then k + 1 tokens
        theirs.truncate(10)
        verify = torch.randn(1, 4, 32)
        worst = max(worst, max_diff(engine.decode(verify.numpy(), [mine]), block(verify, caches=[theirs])))
        # continuous batching: three streams of different lengths in one call
        caches = [(engine.new_cache(), block.new_cache()) for _ in range(3)]
        for n, (a, b) in zip((1, 4, 9), caches, strict=True):
            x = torch.randn(1, n, 32)
            engine.decode(x.numpy(), [a])
            block(x, caches=[b])
        rows = torch.randn(3, 1, 32)
        got = engine.decode(rows.numpy(), [a for a, _ in caches])
        worst = max(worst, max_diff(got, block(rows, caches=[b for _, b in caches])))
    assert worst < LEAN_TOL
    assert mine.nbytes == theirs.nbytes and mine.capacity_after(40) == theirs.capacity_after(40)
    assert engine.kv_bytes_per_token == 2 * 2 * 8 * 4


def test_the_numpy_engine_refuses_tampered_or_misfit_weights(tmp_path: Path) -> None:
    from layerswarm.models.checkpoint import ModelDirError

    model_dir = make_model_dir(tmp_path / "m")
    path = model_dir / "block_01.safetensors"
    path.write_bytes(path.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(ModelDirError, match="sha256"):
        numpy_engine(model_dir, 1)
    with pytest.raises(ModelDirError, match="out of range"):
        numpy_engine(model_dir, 7)


def test_engine_choice_names_the_flag() -> None:
    assert choose_engine("numpy", "cpu") == "numpy"
    assert choose_engine("auto", "cpu") == "torch"  # torch is installed here
    assert choose_engine("torch", "cpu", decoder=True) == "torch"  # asked for: kept


def test_auto_puts_a_decoder_on_numpy_on_the_cpu_and_on_torch_on_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoder's one-token steps are faster in numpy at every width measured; a classifier stays on
    torch (bit-exact with the torch monolith), and a GPU is torch's."""
    assert choose_engine("auto", "cpu", decoder=True) == "numpy"
    assert choose_engine("auto", "auto", decoder=True) == "numpy"  # no CUDA on this machine
    monkeypatch.setattr("layerswarm.node.engines.cuda_available", lambda: True)
    assert choose_engine("auto", "auto", decoder=True) == "torch"
    assert choose_engine("auto", "cuda", decoder=True) == "torch"
    model_dir = tmp_path / "lm"
    make_lm_dir(model_dir, seed=6)
    assert serves_decoder(model_dir) and not serves_decoder(make_model_dir(tmp_path / "vit"))
    assert not serves_decoder(tmp_path / "nowhere")  # the node's start says why
    monkeypatch.undo()
    engine = load_engine(model_dir, 1, read_any_manifest(model_dir), "auto", "cpu")
    assert engine.name == "numpy"
    with pytest.raises(EngineError, match="--engine numpy computes on the CPU"):
        choose_engine("numpy", "cuda")


def test_codec_and_arrays_write_the_same_bytes() -> None:
    """One format: the torch face and the numpy core encode every dtype alike and decode each other."""
    torch.manual_seed(5)
    x = torch.randn(2, 3, 8) * 100
    for dtype, code in [(torch.float32, arrays.FP32), (torch.float16, arrays.FP16), (torch.bfloat16, arrays.BF16)]:
        assert codec.encode(x, dtype).SerializeToString() == arrays.encode(x.numpy(), code).SerializeToString()
    assert codec.encode(x, torch.int8).SerializeToString() == arrays.encode(x.numpy(), arrays.INT8).SerializeToString()
    bf = codec.encode(x, torch.bfloat16)
    assert np.array_equal(arrays.decode(bf), codec.decode(bf).float().numpy())


# -- a node where `import torch` fails ---------------------------------------------------------------

BLOCKER = '''
import sys


class NoTorch:
    """`import torch` (and anything under it) fails here, as on a board where it is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, NoTorch())
'''


@pytest.fixture
def no_torch_env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "no-torch"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_the_blocker_blocks_torch(no_torch_env: dict[str, str]) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import torch"], env=no_torch_env, capture_output=True, text=True, check=False
    )
    assert result.returncode != 0 and "blocked by the test" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["vit", "lm"])
async def test_a_node_serves_where_torch_cannot_be_imported(
    tmp_path: Path, no_torch_env: dict[str, str], kind: str
) -> None:
    """`layerswarm node` with no torch: auto picks numpy, it serves Forward (and Decode for a decoder) within
    LEAN_TOL of the torch block, refuses bad input with INVALID_ARGUMENT and a call without the swarm
    token with UNAUTHENTICATED, like any node."""
    if kind == "vit":
        model_dir = make_model_dir(tmp_path / "m", variant="layershuffle-position")
    else:
        model_dir = tmp_path / "lm"
        make_lm_dir(model_dir, seed=6)
    token = tmp_path / "token"
    token.write_text("a-swarm-token-for-this-test-only-0123456789")
    token.chmod(0o600)
    proc = spawn("lean-node", node_cmd(model_dir, 1, "--no-advertise", "--token-file", str(token)), env=no_torch_env)
    try:
        assert proc.ready["engine"] == "numpy" and proc.ready["device"] == "cpu"
        block = load_block(model_dir, 1, read_any_manifest(model_dir))
        torch.manual_seed(7)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{proc.ready['port']}") as channel:
            stub = pb_grpc.BlockNodeStub(channel)
            x = torch.randn(1 if kind == "lm" else 2, 5, 32)
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # no token: refused before anything
                await stub.Forward(pb.ForwardRequest(activations=codec.encode(x), position=1), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            signer = CallSigner(token.read_text().strip())
            nonce = signer.new_nonce()
            info = stub.Info(pb.InfoRequest(), metadata=((NONCE_KEY, nonce),))
            reply = await info
            assert signer.accept_info(await info.trailing_metadata(), nonce, info_identity(reply))
            assert reply.weights_sha256 == read_any_manifest(model_dir).block_sha256(1)

            def signed(method: str) -> tuple[tuple[str, str]]:
                return (signer.sign(f"/layerswarm.v1.BlockNode/{method}"),)

            with torch.inference_mode():
                want = block(x) if kind == "lm" else block(x, 1)
            out = await stub.Forward(
                pb.ForwardRequest(activations=codec.encode(x), position=1), metadata=signed("Forward"), timeout=10
            )
            assert float((codec.decode(out.activations) - want).abs().max()) < LEAN_TOL
            bad = codec.encode(torch.full((1, 5, 32), float("nan")))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Forward(pb.ForwardRequest(activations=bad, position=1), metadata=signed("Forward"))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            if kind == "lm":  # a stream: prefill then steps, against the torch block with its cache
                cache = block.new_cache()
                start = 0
                for tokens in (5, 1, 1):
                    step = torch.randn(1, tokens, 32)
                    request = pb.DecodeRequest(stream_id="s1", start=start, activations=codec.encode(step))
                    got = await stub.Decode(request, metadata=signed("Decode"), timeout=10)
                    with torch.inference_mode():
                        want = block(step, caches=[cache])
                    assert float((codec.decode(got.activations) - want).abs().max()) < LEAN_TOL
                    start += tokens
                    assert got.length == start
    finally:
        stop_all([proc])
