"""What the HTTP surface needs of the running coordinator: an interface, so that http/ never imports
the process above it (coordinator/process.py: Coordinator is the one implementation)."""

from __future__ import annotations

from typing import Protocol

from layerswarm.models.checkpoint import AnyManifest

from ..generation.generator import Generator
from ..membership.registry import Registry
from ..metrics import CoordinatorMetrics
from ..routing.router import Router
from ..settings import CoordinatorSettings
from .admission import Admission


class Service(Protocol):
    @property
    def settings(self) -> CoordinatorSettings: ...

    @property
    def manifest(self) -> AnyManifest: ...  # the model it serves, either kind

    @property
    def generative(self) -> bool: ...  # a decoder family (generator), else a classifier's (router)

    @property
    def router(self) -> Router: ...  # a classifier family's: classify (a decoder's raises)

    @property
    def generator(self) -> Generator: ...  # a decoder family's: streams (a classifier's raises)

    @property
    def registry(self) -> Registry: ...  # the swarm as seen: /v1/nodes, the page

    @property
    def metrics(self) -> CoordinatorMetrics: ...

    @property
    def admission(self) -> Admission: ...  # the one count of requests in flight

    def ready(self) -> tuple[bool, str]: ...  # readiness and why (/readyz, /v2/health/ready, the page)

    def take_tip(self, body: bytes, mac: str | None) -> bool: ...  # another coordinator's conviction (tips.py)
