"""The forging device: its own host on the chaos LAN, with no key, doing what a stranger can.

Each attack round is one short process on that host (`python -m layerswarm.chaos.forging ROUND`), using
real zeroconf from harness/forge.py:

- `forge`: asks every real node for its open Info (anyone may), then sends mDNS goodbyes under each
  real node's own instance name, and adverts of another family pointing at every real node's address
  (three times over), plus adverts for addresses nobody vouched for.
- `steal`: poses as a real node (its Info and a proof it gave for another nonce) on the forger's own
  address, advertised with real zeroconf; records every call the coordinator makes to it for a while;
  then replays each captured call's metadata to the real node. Prints what it captured and whether any
  replay was accepted.

The driver (`ForgingDevice`) runs the rounds and keeps their results for the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from typing import Any

import grpc
import torch
from zeroconf import IPVersion, ServiceInfo
from zeroconf.asyncio import AsyncZeroconf

from layerswarm.harness.forge import MdnsAttacker, RecordingImpostor
from layerswarm.wire import codec
from layerswarm.wire.auth import NONCE_KEY
from layerswarm.wire.discovery import PROTOCOL_VERSION, SERVICE_TYPE, Advert, instance_name
from layerswarm.wire.v1 import block_pb2 as pb
from layerswarm.wire.v1 import block_pb2_grpc as pb_grpc

from .swarm import NODE_PORT, ChaosSwarm

FOREIGN_FAMILY = "fam-forged-by-the-stranger"


class ForgingDevice:
    """Driver side: a host in the lab and the results of every round run from it."""

    def __init__(self, swarm: ChaosSwarm) -> None:
        self.swarm = swarm
        self.host = swarm.lab.add_host("forger")
        self.rounds: list[dict[str, Any]] = []

    def _targets(self) -> list[str]:
        return [n.address for n in self.swarm.nodes if n.proc is not None and n.proc.alive and n.name != "joiner"]

    def run_round(self, kind: str, listen_s: float = 3.0, token: str | None = None) -> dict[str, Any]:
        argv = [sys.executable, "-m", "layerswarm.chaos.forging", kind, "--listen-s", str(listen_s)]
        argv += ["--targets", ",".join(self._targets())]
        started = time.monotonic()
        result: dict[str, Any] = {"kind": kind, "at": started}
        try:
            done = subprocess.run(
                self.host.command(argv), capture_output=True, text=True, timeout=60 + listen_s, check=False
            )
        except subprocess.TimeoutExpired:
            result.update(rc=None, error="the round did not finish in time")
            self.rounds.append(result)
            return result
        result["rc"] = done.returncode
        try:
            result.update(json.loads(done.stdout.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            result["error"] = done.stderr.strip()[-500:]
        if token is not None and "captured" in result:  # the stranger must never have seen the secret
            result["token_seen"] = any(token in v for _, md in result["captured"] for _, v in md)
        self.rounds.append(result)
        return result

    def attack_round(self) -> dict[str, Any]:
        return self.run_round("forge")

    def summary(self) -> dict[str, Any]:
        steals = [r for r in self.rounds if r["kind"] == "steal"]
        return {
            "host": self.host.address,
            "rounds": len(self.rounds),
            "forge_rounds": sum(r["kind"] == "forge" for r in self.rounds),
            "goodbyes_sent": sum(r.get("goodbyes", 0) for r in self.rounds),
            "foreign_adverts_sent": sum(r.get("foreign_adverts", 0) for r in self.rounds),
            "steal_rounds": len(steals),
            "calls_captured": sum(len(r.get("captured", [])) for r in steals),
            "methods_captured": sorted({m for r in steals for m, _ in r.get("captured", [])}),
            "replays": sum(r.get("replays", 0) for r in steals),
            "replays_accepted": sum(r.get("replays_accepted", 0) for r in steals),
            "token_seen": any(r.get("token_seen") for r in steals),
            "failed_rounds": [r for r in self.rounds if r.get("rc") != 0][:3],
        }


# --- the forger's side: runs on its own host ---------------------------------------------------------


async def _info(address: str) -> tuple[pb.NodeInfo, tuple[tuple[str, str], ...]] | None:
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.BlockNodeStub(channel)  # type: ignore[no-untyped-call]
            call = stub.Info(pb.InfoRequest(), metadata=((NONCE_KEY, "f" * 24),), timeout=2)
            info = await call
            trailing = tuple((k, str(v)) for k, v in (await call.trailing_metadata() or ()))
    except grpc.aio.AioRpcError:
        return None  # frozen, killed or cut off right now: skip it
    return info, trailing


async def forge(targets: list[str]) -> dict[str, Any]:
    attacker = MdnsAttacker()
    goodbyes: list[ServiceInfo] = []
    foreign: list[ServiceInfo] = []
    for i, address in enumerate(targets):
        host, _, port = address.rpartition(":")
        got = await _info(address)
        if got is not None:
            info = got[0]
            own = instance_name(info.model_id, info.block_index, info.boot_id)
            goodbyes.append(attacker.info(own, host, int(port), info.family_id, info.block_index))
        foreign.append(attacker.info(f"forged-{i}", host, int(port), FOREIGN_FAMILY))
    strangers = [attacker.info(f"stranger-{i}", f"198.18.0.{200 + i}", NODE_PORT, FOREIGN_FAMILY) for i in range(4)]
    try:
        for _ in range(3):
            attacker.send(foreign + strangers, ttl=120)
            await asyncio.sleep(0.2)
        attacker.send(goodbyes + foreign, ttl=0)
        await asyncio.sleep(0.5)  # let the packets leave before the socket closes
    finally:
        await attacker.close()
    return {"goodbyes": len(goodbyes), "foreign_adverts": 3 * (len(foreign) + len(strangers))}


async def steal(targets: list[str], listen_s: float) -> dict[str, Any]:
    """Pose as the first reachable real node; record; replay to it."""
    victim, got = None, None
    for address in targets:
        got = await _info(address)
        if got is not None:
            victim = address
            break
    if victim is None or got is None:
        return {"error": "no real node answered Info"}
    info, trailing = got
    impostor = RecordingImpostor(info, trailing)
    server = grpc.aio.server()
    pb_grpc.add_BlockNodeServicer_to_server(impostor, server)  # type: ignore[no-untyped-call]
    own = _own_address()
    server.add_insecure_port(f"{own}:{NODE_PORT}")
    await server.start()
    azc = AsyncZeroconf(ip_version=IPVersion.V4Only)
    sha = info.weights_sha256[:16]
    advert = Advert(info.family_id, info.model_id, info.block_index, info.variant, PROTOCOL_VERSION, "b" * 32, sha)
    service = ServiceInfo(
        SERVICE_TYPE,
        instance_name(info.model_id, info.block_index, advert.boot),
        addresses=[socket.inet_aton(own)],
        port=NODE_PORT,
        properties=advert.to_txt(),
        server="impostor.local.",
    )
    try:
        await azc.async_register_service(service)
        await asyncio.sleep(listen_s)
        await azc.async_unregister_service(service)
    finally:
        await azc.async_close()
        await server.stop(0)
    replays, accepted = 0, 0
    async with grpc.aio.insecure_channel(victim) as channel:
        stub = pb_grpc.BlockNodeStub(channel)  # type: ignore[no-untyped-call]
        for _, metadata in impostor.received:
            replays += 1
            request = pb.ForwardRequest(activations=codec.encode(torch.randn(1, info.tokens, info.dim)), position=0)
            try:
                await stub.Forward(request, metadata=metadata, timeout=2)
                accepted += 1
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not grpc.StatusCode.UNAUTHENTICATED:
                    accepted += 1  # anything but a refusal of the credentials counts against the defence
    return {
        "victim": victim,
        "impostor": f"{own}:{NODE_PORT}",
        "captured": [[m, list(md)] for m, md in impostor.received],
        "replays": replays,
        "replays_accepted": accepted,
    }


def _own_address() -> str:
    """This host's lab address (eth0 of its namespace): the route the LAN would use."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("198.18.0.1", 9))
        return str(probe.getsockname()[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerswarm.chaos.forging")
    p.add_argument("round", choices=["forge", "steal"])
    p.add_argument("--targets", required=True, help="comma-separated HOST:PORT of real nodes")
    p.add_argument("--listen-s", type=float, default=3.0)
    args = p.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    result = asyncio.run(forge(targets) if args.round == "forge" else steal(targets, args.listen_s))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
