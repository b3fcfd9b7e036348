"""What a Coordinator is built from, read from its settings: the family it serves (classifier or decoder),
its minimum depth, its verifier and wire format, and how node state changes are logged."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from layerswarm.models import policy
from layerswarm.models.adaptive_policy import read_policy
from layerswarm.models.checkpoint import AnyManifest, Manifest, ModelDirError, read_any_manifest
from layerswarm.models.config import ViTConfig
from layerswarm.models.lm.config import LMConfig
from layerswarm.wire import codec

from .membership.records import FamilySpec, NodeEvent, NodeState
from .routing.depth import DepthRule
from .routing.wire_choice import WireChoice, WireFormat, measure_codec_ms_per_mb
from .settings import CoordinatorSettings
from .verification.decode_check import DecodeVerifier
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


def family_spec(settings: CoordinatorSettings, own: AnyManifest) -> FamilySpec:
    """The coordinator's family, with the weights its own and sibling manifests vouch for. A decoder
    family's nodes state its context as their tokens."""
    known: dict[tuple[str, int], str] = {}
    for model_dir in (settings.model_dir, *settings.family_dirs):
        manifest = own if model_dir == settings.model_dir else read_any_manifest(model_dir)
        if manifest.family_id != own.family_id:
            raise ModelDirError(f"{model_dir} is of family {manifest.family_id}, not {own.family_id}")
        for i in range(manifest.config.depth):
            known[(manifest.model_id, i)] = manifest.block_sha256(i)
    cfg = own.config
    strict = bool(settings.family_dirs) if settings.strict is None else settings.strict
    if isinstance(cfg, LMConfig):
        return FamilySpec(own.family_id, cfg.depth, cfg.max_seq_len, cfg.dim, known, strict, generative=True)
    return FamilySpec(own.family_id, cfg.depth, cfg.num_tokens, cfg.dim, known, strict)


def depth_rule(settings: CoordinatorSettings, manifest: Manifest) -> DepthRule:
    """How many blocks a request needs (routing/depth.py): the flags, else the model's own evaluation
    and calibration files. Raises ValueError for a flag past the model's depth."""
    depth = manifest.config.depth
    min_blocks, source = readiness_minimum(settings, manifest)
    policy = read_policy(settings.model_dir) or {}
    calibrated = policy.get("anytime_min_blocks")
    if settings.anytime_min_blocks is not None:
        if settings.anytime_min_blocks > depth:
            raise ValueError(f"--anytime-min-blocks {settings.anytime_min_blocks} is past the model's depth of {depth}")
        anytime, anytime_source = settings.anytime_min_blocks, "--anytime-min-blocks"
    elif isinstance(calibrated, int) and 1 <= calibrated <= depth:
        margin = float(policy.get("anytime_margin", 0.1)) * 100
        anytime, anytime_source = calibrated, f"calibrated: within {margin:g} points of the full path, adaptive.json"
    else:
        anytime, anytime_source = min_blocks, "the readiness minimum: no calibrated anytime floor"
    return DepthRule(depth, min_blocks, source, anytime, anytime_source, repeats=bool(policy.get("repeats")))


def readiness_minimum(settings: CoordinatorSettings, manifest: AnyManifest) -> tuple[int, str]:
    """--min-blocks, else the minimum useful depth `layerswarm eval` measured, else 1 (with a warning);
    and where the number came from."""
    depth = manifest.config.depth
    if settings.min_blocks is not None:
        if settings.min_blocks > depth:  # paths past the depth: every node would refuse them
            raise ValueError(f"--min-blocks {settings.min_blocks} is past the model's depth of {depth}")
        return settings.min_blocks, "--min-blocks"
    evaluated = policy.min_blocks(manifest)
    if evaluated is None:
        if settings.model_dir not in _WARNED:  # once per process: benches build many coordinators
            _WARNED.add(settings.model_dir)
            log.warning("%s has no evaluated minimum depth (run layerswarm eval): min_blocks is 1", settings.model_dir)
        return 1, "no evaluated minimum depth: run layerswarm eval"
    entry = policy.entry(manifest, policy.MIN_BLOCKS) or {}
    margin = float(entry.get("margin", 0.01)) * 100
    return evaluated, f"the evaluated minimum useful depth, within {margin:g} point{'s' * (margin != 1)} of full depth"


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


def generation_wire(settings: CoordinatorSettings) -> torch.dtype:
    """How a decoder's activations travel: --wire-dtype, with auto as fp16 (one token's states are a few
    kB: no link is slow enough for int8's codec to pay)."""
    return codec.dtype_by_name("fp16" if settings.wire_dtype == "auto" else settings.wire_dtype)


def make_decode_verifier(settings: CoordinatorSettings) -> DecodeVerifier | None:
    """A decoder family's checks: re-execution on the coordinator's own copies (decode hops have no
    replicas' majority yet)."""
    if settings.verify_rate is None:
        return None
    verify = VerifySettings(rate=settings.verify_rate, probation_hops=settings.verify_probation)
    return DecodeVerifier([settings.model_dir, *settings.family_dirs], verify)


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
