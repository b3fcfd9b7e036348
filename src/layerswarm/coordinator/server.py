"""Run a coordinator: discovery + health monitoring + the HTTP API under uvicorn."""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket

import uvicorn

from .http.app import create_app
from .http.guarded_h11 import guarded_protocol
from .http.ops import insecure_notice
from .memory import HeapKeeper
from .process import Coordinator
from .settings import CoordinatorSettings

log = logging.getLogger(__name__)

SPARE_FILES = 256  # descriptors beyond the HTTP connections: gRPC channels to nodes, model files, logs


async def serve(settings: CoordinatorSettings) -> None:
    listener = _listen(settings.http_host, settings.http_port)  # first: a taken port is a one-line error
    coordinator = Coordinator(settings)
    if (notice := insecure_notice(settings)) is not None:
        log.warning("%s", notice)
    await coordinator.start()
    heap = HeapKeeper()  # what the arenas keep free goes back to the kernel (memory.py)
    heap.start()
    app = create_app(coordinator)
    _ensure_file_limit(settings.max_connections + SPARE_FILES)
    counter = coordinator.metrics.connections_closed
    config = uvicorn.Config(
        app,
        host=settings.http_host,
        port=settings.http_port,
        http=guarded_protocol(
            settings.header_timeout_s,
            settings.body_timeout_s,
            settings.max_connections,
            on_close=lambda reason: counter.labels(reason).inc(),
            write_timeout_s=settings.write_timeout_s,
            max_header_bytes=settings.max_header_bytes,
        ),
        log_level="warning",
        lifespan="off",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    app.state.server = server  # open event streams end when it exits (else shutdown waits for them)
    task = asyncio.create_task(server.serve(sockets=[listener]))  # uvicorn handles SIGINT/SIGTERM itself
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            print(
                json.dumps(
                    {
                        "event": "ready",
                        "role": "coordinator",
                        "host": settings.http_host,
                        "port": port,
                        "family_id": coordinator.manifest.family_id,
                        "readiness": coordinator.readiness(),  # how many blocks must answer, and why
                    }
                ),
                flush=True,
            )
        await task
    finally:
        if app.state.decoder is not None:  # a decoder family's app decodes no images
            app.state.decoder.close()
        await heap.stop()
        await coordinator.stop()


def _listen(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound here rather than by uvicorn, which exits with a traceback when it cannot."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"--http-host/--http-port: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def _ensure_file_limit(needed: int) -> None:
    """Raise the soft open-files limit to `needed` when the hard limit allows: the connection cap, not
    the kernel, must be what refuses a flood of connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log.warning("open-files limit %d is below --max-connections + %d; lower --max-connections", target, SPARE_FILES)


def run(settings: CoordinatorSettings) -> int:
    asyncio.run(serve(settings))
    return 0
