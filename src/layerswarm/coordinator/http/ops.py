"""What operators and orchestrators read: the swarm (/v1/nodes), liveness, readiness, metrics."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from layerswarm.wire.exposure import insecure_notice as exposure_notice

from ..membership.tips import MAC_HEADER, TipError
from ..settings import CoordinatorSettings
from .errors import error_response
from .service import Service


def insecure_notice(settings: CoordinatorSettings) -> str | None:
    """The warning of a coordinator serving beyond loopback on --insecure (None: it is not)."""
    return exposure_notice(settings.http_host, settings.security, settings.insecure)


def mount_ops(app: FastAPI, service: Service) -> None:
    manifest = service.manifest
    cfg = manifest.config

    @app.post("/v1/swarm/tips", include_in_schema=False)
    async def tips(request: Request) -> Response:
        """Another coordinator of this swarm convicted a node (membership/tips.py): we re-check it."""
        try:
            acted = service.take_tip(await request.body(), request.headers.get(MAC_HEADER))
        except TipError as exc:
            return error_response(exc.status, "tip_refused", str(exc))
        return JSONResponse({"acted": acted})

    @app.get("/v1/nodes")
    async def nodes() -> dict[str, Any]:
        """The swarm as this coordinator sees it, ignored nodes (and why) included."""
        ready, reason = service.ready()
        return {
            "family_id": manifest.family_id,
            "model_id": manifest.model_id,
            "variant": cfg.variant,
            "depth": cfg.depth,
            "reachable_depth": service.registry.reachable_depth(),
            "ready": ready,
            "reason": reason,
            # Served beyond loopback without a swarm token or TLS (--insecure): membership is unauthenticated.
            "insecure": insecure_notice(service.settings),
            # Weights whose replicas disagreed where the coordinator holds no copy: routed to by nobody for now.
            "contested": service.registry.contested_view(),
            "nodes": service.registry.snapshot(),
        }

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """Liveness: the process serves HTTP."""
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {}})
    async def readyz() -> JSONResponse:
        """Readiness: the family's minimum depth is reachable."""
        ready, reason = service.ready()
        return JSONResponse(
            status_code=200 if ready else 503, content={"status": "ready" if ready else "not_ready", "detail": reason}
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics."""
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
