"""The family members whose stem and head the coordinator holds, for ensembles over members.

Routes of one model in other random orders are not diverse enough to pay on hard inputs (on the
noisy split of the shipped family two such routes gain little, docs/adaptive.md); routes
through *other members* (their own stem, blocks and head: independently trained models) are. The
coordinator already holds every `--family-dir` (its verifier and strict admission read them), so an
ensemble route i >= 1 can run member i's stem, prefer member i's nodes, and read member i's head.

A member takes part only when its stem reads the same input as ours (image size, patch, channels,
normalisation; for text, the same tokenizer file) and its head answers the same classes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from layerswarm.models.checkpoint import Manifest, read_manifest
from layerswarm.models.checkpoint import load_stem_head as load_parts
from layerswarm.models.config import ViTConfig

log = logging.getLogger(__name__)
TOKENIZER = "tokenizer.json"


@dataclass(frozen=True)
class Member:
    model_id: str
    stem: nn.Module
    head: nn.Module


def interchangeable(own: ViTConfig, other: ViTConfig, own_dir: Path, other_dir: Path) -> bool:
    """Does `other` read our inputs and answer our classes (so its logits can be averaged with ours)?"""
    same_io = (
        own.kind == other.kind
        and own.image_size == other.image_size
        and own.patch_size == other.patch_size
        and own.in_channels == other.in_channels
        and own.image_mean == other.image_mean
        and own.image_std == other.image_std
        and own.num_classes == other.num_classes
        and own.class_names == other.class_names
        and own.dim == other.dim
    )
    if not same_io:
        return False
    if own.kind == "text":  # token ids mean the same only under the very same tokenizer
        return (own_dir / TOKENIZER).read_bytes() == (other_dir / TOKENIZER).read_bytes()
    return True


def load_members(
    own_dir: Path, own: Manifest, stem: nn.Module, head: nn.Module, others: tuple[Path, ...]
) -> list[Member]:
    """Our own model first, then every family dir that is interchangeable with it."""
    members = [Member(own.model_id, stem, head)]
    for model_dir in others:
        manifest = read_manifest(model_dir)
        if manifest.model_id == own.model_id:
            continue
        if not interchangeable(own.config, manifest.config, own_dir, model_dir):
            log.info("%s takes no ensemble routes: its stem or head differ from %s", model_dir, own_dir)
            continue
        member_stem, member_head = load_parts(model_dir, manifest)
        members.append(Member(manifest.model_id, member_stem, member_head))
    return members
