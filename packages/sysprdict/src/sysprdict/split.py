"""Leave-architecture-out: held-out families share no component with the training families.

Zoo families are built from shared parts (a LLaVA is a CLIP tower + a projector + a Llama), so
holding out a family name is not holding out an architecture.  A component here is a module class
transformers defines for one model family (`zoo.components`); the strict split keeps in training
only the families that have none of the held-out families' components.
"""

from __future__ import annotations

import functools

import torch

from .names import FAMILIES, HELDOUT_FAMILIES
from .zoo import build, components

__all__ = ["family_components", "strict_split"]


@functools.cache
def family_components(family: str) -> frozenset[str]:
    """The components of `family` (built at the smallest size on the meta device: no memory)."""
    with torch.device("meta"):
        return frozenset(components(build(f"{family}-xs").module))


def strict_split(
    heldout: tuple[str, ...] = tuple(HELDOUT_FAMILIES), candidates: tuple[str, ...] = tuple(FAMILIES)
) -> tuple[list[str], dict[str, list[str]]]:
    """(training families, {excluded family: the held-out components it shares}): every candidate
    that shares no component with any held-out family trains; the others are left out."""
    held: set[str] = set()
    for f in heldout:
        held |= family_components(f)
    train, excluded = [], {}
    for f in candidates:
        if f in heldout:
            continue
        shared = sorted(family_components(f) & held)
        if shared:
            excluded[f] = shared
        else:
            train.append(f)
    return train, excluded
