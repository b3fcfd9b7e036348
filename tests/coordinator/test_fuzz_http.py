"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis): no 5xx but the deliberate 503, no hang."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from layerswarm.harness.procs import stop_all

from ..swarm import coordinator_process, start_nodes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api_schema(family_dirs: list[Path]) -> Iterator[schemathesis.BaseSchema]:
    nodes = start_nodes([(family_dirs[0], b) for b in range(3)])
    coord = coordinator_process(family_dirs[0], nodes, "--max-upload-bytes", "100000")
    try:
        yield schemathesis.openapi.from_url(f"http://127.0.0.1:{coord.ready['port']}/openapi.json")
    finally:
        stop_all([coord, *nodes])


OPERATIONS = [
    ("POST", "/v1/classify"),
    ("GET", "/v1/nodes"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("POST", "/v1/classify/batch"),
    ("GET", "/v1/swarm"),
    ("GET", "/v2/health/ready"),
    ("GET", "/v2/models/{model}"),
    ("POST", "/v2/models/{model}/infer"),
]


# Valid requests for every operation; invalid ones (negative mode) where there is input to break.
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in (("POST", "/v1/classify"), ("POST", "/v1/classify/batch"))
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_no_server_errors_and_no_hangs(
    api_schema: schemathesis.BaseSchema, method: str, path: str, mode: GenerationMode
) -> None:
    operation = api_schema[path][method]

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        response = case.call(timeout=15)  # a hang fails the test instead of stalling it
        if response.status_code == 503:  # deliberate: too few blocks for the asked depth, or not ready
            assert response.json().get("error", "not_ready") in ("insufficient_depth", "not_ready"), response.text
        else:
            assert response.status_code < 500, response.text
        if response.status_code >= 400 and path.startswith("/v1/classify"):
            body = response.json()
            assert body["error"] and body["detail"]  # every error is JSON with a reason

    check()
