"""Relay chains under mutual TLS: the star answer, what a relay certificate may call, and a node without one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from layerswarm.coordinator import NodeClient
from layerswarm.harness.procs import Proc, stop_all
from layerswarm.wire import codec
from layerswarm.wire.security import SecuritySettings
from layerswarm.wire.v1 import block_pb2 as pb

from ..conftest import make_model_dir
from ..relay_lab import SEQ, TOKEN, images
from ..swarm import address, coordinator, start_nodes, wait_until


@pytest.fixture(scope="module")
def tls_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, dict[str, Any], list[Proc]]]:
    """Three node processes with mutual TLS, the token and relay certificates (deploy/make-certs.sh)."""
    import subprocess

    root = tmp_path_factory.mktemp("relay-tls")
    certs = root / "certs"
    make = [str(Path(__file__).resolve().parents[2] / "deploy" / "make-certs.sh"), str(certs)]
    subprocess.run(["bash", *make], check=True, capture_output=True)
    model_dir = make_model_dir(root / "m", depth=3)
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    node_tls = [
        "--token-file",
        str(token_file),
        "--tls-cert",
        str(certs / "node.pem"),
        "--tls-key",
        str(certs / "node.key"),
    ]
    node_tls += ["--tls-ca", str(certs / "ca.pem")]
    relay = ["--tls-relay-cert", str(certs / "relay.pem"), "--tls-relay-key", str(certs / "relay.key")]
    procs = start_nodes([(model_dir, 0), (model_dir, 1), (model_dir, 2)], *node_tls, *relay)
    coord = {
        "token_file": token_file,
        "tls_cert": certs / "coordinator.pem",
        "tls_key": certs / "coordinator.key",
        "tls_ca": certs / "ca.pem",
        "verify_rate": None,
        "node_args": node_tls,
    }
    try:
        yield model_dir, certs, coord, procs
    finally:
        stop_all(procs)


async def _classify_with(model_dir: Path, procs: list[Proc], topology: str, coord_args: dict[str, Any]) -> Any:
    settings = {k: v for k, v in coord_args.items() if k != "node_args"}
    coord = coordinator(model_dir, procs, topology=topology, **settings)
    await coord.start()
    try:
        await wait_until(lambda: coord.registry.reachable_depth() == 3, what="all blocks reachable")
        return await coord.router.classify(images(), SEQ)
    finally:
        await coord.stop()


async def test_relay_chains_under_mutual_tls_give_the_star_answer(
    tls_swarm: tuple[Path, Path, dict[str, Any], list[Proc]],
) -> None:
    model_dir, _, coord_args, procs = tls_swarm
    star = await _classify_with(model_dir, procs, "star", coord_args)
    relayed = await _classify_with(model_dir, procs, "relay", coord_args)
    assert [h.outcome for h in relayed.path.hops] == ["relayed"] * 3  # node -> node, on relay certificates
    assert torch.equal(relayed.probs, star.probs)


async def test_a_relay_certificate_may_call_relay_and_info_but_not_forward(
    tls_swarm: tuple[Path, Path, dict[str, Any], list[Proc]],
) -> None:
    _, certs, _, procs = tls_swarm
    pem = {name: (certs / f"relay.{name}").read_bytes() for name in ("pem", "key")}
    security = SecuritySettings(TOKEN, pem["pem"], pem["key"], (certs / "ca.pem").read_bytes())
    client = NodeClient(address(procs[1]), 64 * 1024 * 1024, security=security)
    try:
        await client.info(2.0)  # the handshake a forwarding node makes
        forward = pb.ForwardRequest(request_id="r", activations=codec.encode(torch.zeros(1, 5, 32)), position=1)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.forward(forward, 2.0)
        assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
        step = pb.RelayStep(address=address(procs[1]), position=0, block=1)
        unmaced = pb.RelayRequest(forward=forward, chain=[step], hop_timeout_s=1.0, deadline_s=1.0, plan_mac="x")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.relay(unmaced, 5.0)  # the role passes; the chain still needs the coordinator's MAC
        assert "relay chain refused" in (caught.value.details() or "")
    finally:
        await client.close()
    probe_pem = {name: (certs / f"probe.{name}").read_bytes() for name in ("pem", "key")}
    probe = SecuritySettings(None, probe_pem["pem"], probe_pem["key"], (certs / "ca.pem").read_bytes())
    other = NodeClient(address(procs[1]), 64 * 1024 * 1024, security=probe)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await other.relay(unmaced, 5.0)  # another client certificate of the swarm: refused before the token
        assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
    finally:
        await other.close()


async def test_a_node_without_a_relay_certificate_is_refused_chains_and_requests_still_answer(
    tls_swarm: tuple[Path, Path, dict[str, Any], list[Proc]],
) -> None:
    model_dir, _, coord_args, procs = tls_swarm
    plain = start_nodes([(model_dir, 1)], *coord_args["node_args"])  # TLS and token, no relay certificate
    try:
        swarm = [procs[0], plain[0], procs[2]]
        result = await _classify_with(model_dir, swarm, "relay", coord_args)
        assert result.probs.shape[0] == 2  # answered
        assert any("relay certificate" in h["reason"] for h in result.path.handbacks), result.path.handbacks
    finally:
        stop_all(plain)
