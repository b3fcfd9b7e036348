"""The request and response models of the classify routes, and their OpenAPI request bodies."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_LABEL_CHARS = 256  # a true label is a class name or index: every API holds it to this


class ClassifyParams(BaseModel):
    """Options of one classification (JSON fields, or form fields next to the uploaded file)."""

    model_config = ConfigDict(extra="forbid")
    top_k: int = Field(5, ge=1, le=1000, description="how many labels to return")
    policy: Literal["sequential", "shuffle", "fastest"] | None = Field(
        None, description="path policy; default: shuffle for shuffle-robust families, else sequential"
    )
    seed: int | None = Field(None, ge=0, lt=2**31, description="seed of the random path choices (repeatable)")
    min_blocks: int | None = Field(None, ge=0, le=1024, description="fail with 503 below this many blocks")
    max_blocks: int | None = Field(None, ge=1, le=1024, description="prune the path to at most this many")
    exit_confidence: float | None = Field(
        None, gt=0.0, le=1.0, description="early exit: stop once the top class has this probability"
    )
    exit_rule: Literal["confidence", "entropy", "patience", "none"] | None = Field(
        None, description="early-exit rule (any path order); default: the coordinator's (calibrated) rule"
    )
    exit_threshold: float | None = Field(
        None,
        ge=0.0,
        le=1024,
        description="the rule's threshold: confidence in (0, 1], entropy / log(classes) in [0, 1], patience in "
        "hops; default: the calibrated threshold",
    )
    deadline_ms: float | None = Field(
        None, gt=0.0, le=600_000, description="anytime: answer with what ran once the next hop would miss this budget"
    )
    ensemble: int = Field(1, ge=1, le=8, description="routes through the swarm whose logits are averaged")
    ensemble_mode: Literal["adaptive", "parallel"] = Field(
        "adaptive", description="adaptive: another route only while the answer is unsure; parallel: all at once"
    )
    ensemble_confidence: float | None = Field(
        None, gt=0.0, le=1.0, description="adaptive ensembles: add a route while below this; default: calibrated"
    )
    ensemble_over: Literal["members", "orders"] = Field(
        "members",
        description="members: route i runs the i-th family member the coordinator holds (its stem, nodes and "
        "head; diverse); orders: every route runs the coordinator's own model in another order",
    )
    repeats: bool | None = Field(
        None, description="run reachable blocks again when too few indices are reachable; default: as calibrated"
    )
    resize: bool = Field(False, description="resize images of another size instead of refusing them")
    label: str | None = Field(
        None, max_length=MAX_LABEL_CHARS, description="the true class, if known: counted in the swarm page's accuracy"
    )


class ClassifyJson(ClassifyParams):
    image_base64: str = Field(..., description="the image file (PNG, JPEG, ...), base64-encoded")


class BatchItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image_base64: str = Field(..., description="the image file (PNG, JPEG, ...), base64-encoded")
    label: str | None = Field(None, max_length=MAX_LABEL_CHARS, description="the true class, if known")


class BatchJson(ClassifyParams):
    images: list[BatchItem] = Field(..., min_length=1, description="the batch, in order")


class Label(BaseModel):
    index: int
    label: str
    probability: float


class ItemResult(BaseModel):
    prediction: str
    labels: list[Label]


class BatchResponse(BaseModel):
    results: list[ItemResult] = Field(description="one per input, in order")
    policy: str
    seed: int
    depth: int = Field(description="blocks that ran (the whole batch took one path)")
    exited_early: bool
    elapsed_ms: float
    trace: dict[str, Any] = Field(description="per hop: node, model, block, position, latency, substitutions")


class ClassifyResponse(BaseModel):
    prediction: str
    labels: list[Label]
    policy: str
    seed: int
    depth: int = Field(description="blocks that ran")
    exited_early: bool
    exit_rule: str | None = Field(None, description="the rule that ended a route early")
    anytime: bool = Field(False, description="answered early because the deadline left no time for the next hop")
    routes: int = Field(1, description="routes whose logits were averaged (ensembles)")
    blocks: int = Field(0, description="blocks run, all routes together")
    elapsed_ms: float
    trace: dict[str, Any] = Field(description="per hop: node, model, block, position, latency, substitutions")


def _request_body(file_schema: dict[str, Any], json_model: type[BaseModel], **extra: Any) -> dict[str, Any]:
    """The OpenAPI request body of a classify route: a multipart form (the image file part(s) beside the
    options) or JSON (the model's schema)."""
    form = {"file": file_schema, **ClassifyParams.model_json_schema()["properties"], **extra}
    return {
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": form}},
                "application/json": {"schema": json_model.model_json_schema()},
            },
        }
    }


BINARY = {"type": "string", "format": "binary"}
CLASSIFY_BODY = _request_body(BINARY, ClassifyJson)
BATCH_BODY = _request_body(
    {"type": "array", "items": BINARY}, BatchJson, label={"type": "array", "items": {"type": "string"}}
)
