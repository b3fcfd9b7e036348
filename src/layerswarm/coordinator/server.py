"""Run a coordinator: discovery + health monitoring + the HTTP API under uvicorn."""

from __future__ import annotations

import asyncio
import json
import logging

import uvicorn

from .core import Coordinator
from .http_api import create_app
from .settings import CoordinatorSettings

log = logging.getLogger(__name__)


async def serve(settings: CoordinatorSettings) -> None:
    coordinator = Coordinator(settings)
    await coordinator.start()
    app = create_app(coordinator)
    config = uvicorn.Config(
        app,
        host=settings.http_host,
        port=settings.http_port,
        log_level="warning",
        lifespan="off",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    app.state.server = server  # open event streams end when it exits (else shutdown waits for them)
    task = asyncio.create_task(server.serve())  # uvicorn handles SIGINT/SIGTERM itself
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
                    }
                ),
                flush=True,
            )
        await task
    finally:
        await coordinator.stop()


def run(settings: CoordinatorSettings) -> int:
    asyncio.run(serve(settings))
    return 0
