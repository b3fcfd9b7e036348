"""What a Coordinator is built from, read from its settings: the family it serves, its minimum depth,
its verifier and wire format, and how node state changes are logged."""

from __future__ import annotations

import logging
from pathlib import Path

from layerswarm.models import policy
from layerswarm.models.checkpoint import Manifest, ModelDirError, read_manifest
from layerswarm.models.config import ViTConfig
from layerswarm.wire import codec

from .membership.records import FamilySpec, NodeEvent, NodeState
from .routing.wire_choice import WireChoice, WireFormat, measure_codec_ms_per_mb
from .settings import CoordinatorSettings
from .verification.verifier import Verifier, VerifySettings

log = logging.getLogger("layerswarm.coordinator.process")  # the name operators filter on
NEW_STATES = (NodeState.HEALTHY, NodeState.PENDING)
_WARNED: set[Path] = set()  # model dirs already warned about (no evaluated minimum depth)


def log_node_event(event: NodeEvent) -> None:
    """Every state change of a node, with its reason: ejections and refusals at WARNING."""
    old = event.old.value if event.old else "new"
    new = event.new.value if event.new else "forgotten"
    level = logging.INFO if event.new is None or event.new in NEW_STATES else logging.WARNING
    log.log(level, "node %s: %s -> %s (%s)", event.address, old, new, event.reason)


def family_spec(settings: CoordinatorSettings) -> FamilySpec:
    """The coordinator's family, with the weights its own and sibling manifests vouch for."""
    own = read_manifest(settings.model_dir)
    known: dict[tuple[str, int], str] = {}
    for model_dir in (settings.model_dir, *settings.family_dirs):
        manifest = own if model_dir == settings.model_dir else read_manifest(model_dir)
        if manifest.family_id != own.family_id:
            raise ModelDirError(f"{model_dir} is of family {manifest.family_id}, not {own.family_id}")
        for i in range(manifest.config.depth):
            known[(manifest.model_id, i)] = manifest.block_sha256(i)
    cfg = own.config
    strict = bool(settings.family_dirs) if settings.strict is None else settings.strict
    return FamilySpec(own.family_id, cfg.depth, cfg.num_tokens, cfg.dim, known, strict)


def default_min_blocks(settings: CoordinatorSettings, manifest: Manifest) -> int:
    """--min-blocks, else the minimum useful depth `layerswarm eval` measured, else 1 (with a warning)."""
    if settings.min_blocks is not None:
        if settings.min_blocks > manifest.config.depth:  # paths past the depth: every node would refuse them
            raise ValueError(f"--min-blocks {settings.min_blocks} is past the model's depth of {manifest.config.depth}")
        return settings.min_blocks
    evaluated = policy.min_blocks(manifest)
    if evaluated is None:
        if settings.model_dir not in _WARNED:  # once per process: benches build many coordinators
            _WARNED.add(settings.model_dir)
            log.warning("%s has no evaluated minimum depth (run layerswarm eval): min_blocks is 1", settings.model_dir)
        return 1
    return evaluated


def wire_format(settings: CoordinatorSettings, config: ViTConfig) -> WireFormat:
    """How activations travel: --wire-dtype (fp16 where auto chooses per link), what a reply may be,
    and --frozen-dtype for text."""
    auto = settings.wire_dtype == "auto"
    tokens = None if config.is_text else config.num_tokens  # text: any T up to the maximum
    return WireFormat(
        dtype=codec.dtype_by_name("fp16" if auto else settings.wire_dtype),
        spec=codec.TensorSpec((None, tokens, config.dim), max_batch=settings.max_batch),
        choice=wire_choice(config.num_tokens, config.dim) if auto else None,
        frozen_dtype=None if settings.frozen_dtype == "wire" else codec.dtype_by_name(settings.frozen_dtype),
    )


def wire_choice(tokens: int, dim: int) -> WireChoice:
    """--wire-dtype auto: the int8 codec's cost measured here, once (routing/wire_choice.py)."""
    choice = WireChoice(measure_codec_ms_per_mb(tokens, dim), dim)
    log.info("wire dtype auto: int8 codec %.2f ms per MB of fp16 activations", choice.codec_ms_per_mb)
    return choice


def make_verifier(settings: CoordinatorSettings) -> Verifier | None:
    if settings.verify_rate is None:
        return None
    dirs = [settings.model_dir, *settings.family_dirs]
    return Verifier(
        dirs,
        VerifySettings(
            rate=settings.verify_rate,
            probation_hops=settings.verify_probation,
            reexecute_on=settings.verify_on,
            deferred=settings.verify_deferred,
            decisive=settings.verify_decisive,
            contest_s=settings.verify_contest_s,
        ),
    )
