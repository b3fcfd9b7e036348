"""The coordinator's HTTP app (FastAPI): its middleware, its error map, and its routes, mounted by the
model family it serves.

Every error of the native API is JSON {"error": code, "detail": reason} with a 4xx status (503 when the
swarm is too thin to answer; errors.py); nothing reaches a client as a traceback. An image family mounts
the image routes (classify.py) and KServe v2 inference; a text family mounts /v1/classify/text (text.py);
a decoder family mounts generation: POST /v1/generate (generate.py) and the OpenAI-compatible API
(openai_api.py, its errors in OpenAI's format: openai_errors.py), and no KServe. Each answers the other
families' inference routes with a clear 400 (behind the API keys, like every route).
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from layerswarm import __version__

from .access_log import AccessLog
from .activity import Activity
from .api_keys import ApiKeys
from .bodies import BodySlots
from .classify import IMAGE_ROUTES, mount_images
from .errors import ApiError, install_native_errors
from .front_door import FrontDoor
from .generate import GENERATE_ROUTES, mount_generate
from .imaging import Decoder
from .kserve import INFER_ROUTES, mount_kserve
from .openai_api import OPENAI_ROUTES, mount_openai
from .ops import mount_ops
from .page import mount_page
from .service import Service
from .text import TEXT_ROUTES, mount_text

FOR_TEXT = 'this coordinator serves a text family: POST JSON {"text": ...} to /v1/classify/text'
FOR_IMAGES = "this coordinator serves an image family: use /v1/classify"
FOR_DECODER = "this coordinator serves a language model: POST /v1/generate, /v1/completions or /v1/chat/completions"
FOR_CLASSIFIER = "this coordinator serves a classifier family: use /v1/classify"
GENERATION_ROUTES = (*GENERATE_ROUTES, *OPENAI_ROUTES)


def create_app(service: Service) -> FastAPI:
    if service.generative:
        return _generation_app(service)
    settings, metrics = service.settings, service.metrics
    text = service.router.config.is_text
    activity = Activity()  # recent requests and rates, for the swarm page
    # Swagger UI and ReDoc assets come from the installed package, not a CDN: /docs works offline.
    app = FastAPIOffline(
        title="layerswarm coordinator",
        version=__version__,
        description="Classify images through a swarm of block nodes, in any order.",
    )
    install_native_errors(app, activity)
    # Outermost: the access log and request ids, then API keys, every status counted, quiet disconnects,
    # bugs answered as JSON 500.
    app.add_middleware(FrontDoor, keys=ApiKeys(settings.api_keys), metrics=metrics)
    app.add_middleware(AccessLog, enabled=settings.access_log)
    slots = BodySlots(settings.max_body_reads, metrics.body_reads)
    decoder = Decoder(service.router.config.image_size, settings.max_image_pixels, metrics.decoding)
    app.state.decoder = decoder  # server.py closes its threads
    if not text:
        mount_images(app, service, activity, slots, decoder)
    mount_ops(app, service)
    mount_kserve(app, service, activity, slots, decoder, infer=not text)
    mount_page(app, service, activity)
    if text:
        mount_text(app, service, activity, slots)
    mount_wrong_family(app, (*IMAGE_ROUTES, *INFER_ROUTES) if text else TEXT_ROUTES, FOR_TEXT if text else FOR_IMAGES)
    mount_wrong_family(app, GENERATION_ROUTES, FOR_CLASSIFIER)
    return app


def _generation_app(service: Service) -> FastAPI:
    """A decoder family's app: generation (native and OpenAI-compatible), the page, probes and metrics."""
    settings, metrics = service.settings, service.metrics
    activity = Activity()
    app = FastAPIOffline(
        title="layerswarm coordinator",
        version=__version__,
        description="Generate text through a swarm of decoder-block nodes, token by token: native and "
        "OpenAI-compatible APIs.",
    )
    install_native_errors(app, activity)
    app.add_middleware(FrontDoor, keys=ApiKeys(settings.api_keys), metrics=metrics)
    app.add_middleware(AccessLog, enabled=settings.access_log)
    slots = BodySlots(settings.max_body_reads, metrics.body_reads)
    app.state.decoder = None  # no images to decode
    mount_ops(app, service)
    mount_page(app, service, activity)
    mount_generate(app, service, slots)
    mount_openai(app, service, slots)
    mount_wrong_family(app, (*IMAGE_ROUTES, *TEXT_ROUTES, *INFER_ROUTES), FOR_DECODER)
    return app


def mount_wrong_family(app: FastAPI, paths: Iterable[str], detail: str) -> None:
    """The other family's inference routes: POST answers 400 wrong_family, saying where to go."""

    async def wrong_family() -> None:
        raise ApiError(400, "wrong_family", detail)

    for path in paths:
        app.add_api_route(path, wrong_family, methods=["POST"], include_in_schema=False)
