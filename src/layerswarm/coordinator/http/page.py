"""The swarm page: a live view of nodes, routes and traffic at `/`, fed by server-sent events.

Every asset is a file of the coordinator package (coordinator/static/), so the page works with no internet. The event
stream sends one JSON snapshot per interval: small (a few kB), self-contained, so a page that
missed events simply shows the next one. Text that came from peers (node reasons, addresses) is
only ever put into the page as text by the script, never as HTML.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from ..membership.convictions import ConvictionView
from ..membership.records import NodeRecord
from .activity import Activity
from .ops import insecure_notice
from .service import Service

STATIC = Path(__file__).parents[1] / "static"  # coordinator/static: the package data of the wheel
EVENT_INTERVAL_S = 1.0
SHUTDOWN_CHECKS = 5  # per interval
MAX_EVENT_STREAMS = 32  # open pages at once; more get 429 (each costs a snapshot per second)
ROUTES_SHOWN = 16


def node_view(record: NodeRecord, now: float, convicted: ConvictionView) -> dict[str, Any]:
    """A registry record as the page shows it: plus how long it has been in its state, the link's
    quality (the share of hops sent to it that came back well; health checks are not counted) and its
    address's convictions (`convicted`: `Convictions.view`, as in /v1/nodes)."""
    tried = record.served + record.failed
    return {
        **record.to_json(),
        **convicted,
        "state_for_s": round(max(0.0, now - record.state_since), 1),
        "link_quality": round(record.served / tried, 4) if tried else None,
    }


def swarm_snapshot(service: Service, activity: Activity) -> dict[str, Any]:
    registry, manifest = service.registry, service.manifest
    now = registry.clock()
    ready, reason = service.ready()
    records = sorted(registry.nodes.values(), key=lambda r: (r.block, r.address))
    snapshot: dict[str, Any] = {
        "time": time.time(),
        "swarm": {
            "family_id": manifest.family_id,
            "model_id": manifest.model_id,
            "model_name": service.settings.model_dir.name,
            "variant": manifest.config.variant,
            "depth": manifest.config.depth,
            "reachable_depth": registry.reachable_depth(),
            "ready": ready,
            "reason": reason,
            "in_flight": service.admission.in_flight,  # the count /metrics shows and 429 is decided on
            "insecure": insecure_notice(service.settings),
        },
        "nodes": [node_view(r, now, registry.convictions.view(r.address, registry.wall)) for r in records],
        "stats": activity.stats(),
        "requests": activity.routes(ROUTES_SHOWN),
    }
    if not service.generative:  # star or relay, and under auto what was measured
        snapshot["topology"] = service.router.topology_view()
    if service.generative:  # a decoder family: its live streams and the latest finished ones
        live, recent = service.generator.views()
        snapshot["streams"] = {"live": live, "recent": recent}
    return snapshot


def mount_page(app: FastAPI, service: Service, activity: Activity) -> None:
    streams = {"open": 0}
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/v1/swarm", tags=["swarm page"])
    async def swarm() -> dict[str, Any]:
        """What the swarm page shows, once: nodes (state and why, latency, load, link quality), recent
        requests as routes through the blocks, request rate, errors and accuracy (where labels came)."""
        return swarm_snapshot(service, activity)

    @app.get("/v1/events", tags=["swarm page"], responses={200: {"content": {"text/event-stream": {}}}, 429: {}})
    async def events(request: Request) -> Response:
        """Server-sent events: the `/v1/swarm` snapshot once a second, as `event: swarm`."""
        if streams["open"] >= MAX_EVENT_STREAMS:
            return JSONResponse(
                status_code=429, content={"error": "busy", "detail": f"{MAX_EVENT_STREAMS} event streams open"}
            )

        server = getattr(request.app.state, "server", None)  # uvicorn's, when run by `serve`

        def closing() -> bool:
            return bool(server is not None and server.should_exit)

        async def stream() -> AsyncIterator[str]:
            streams["open"] += 1
            try:
                seq = 0
                while not closing() and not await request.is_disconnected():
                    seq += 1
                    data = json.dumps(swarm_snapshot(service, activity), separators=(",", ":"))
                    yield f"id: {seq}\nevent: swarm\nretry: 2000\ndata: {data}\n\n"
                    for _ in range(SHUTDOWN_CHECKS):  # wake up often enough to let a shutdown through
                        if closing():
                            break
                        await asyncio.sleep(EVENT_INTERVAL_S / SHUTDOWN_CHECKS)
            finally:
                streams["open"] -= 1

        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)
