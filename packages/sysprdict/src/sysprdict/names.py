"""The zoo's model names (FAMILY-SIZE), without torch, so the command line parses them fast."""

from __future__ import annotations

__all__ = ["FAMILIES", "HELDOUT_FAMILIES", "MODALITY", "SIZES", "model_names", "parse_model_name"]

# name -> (hidden, intermediate, layers, heads)
SIZES = {
    "xs": (32, 64, 1, 2),
    "s": (64, 128, 2, 4),
    "m": (96, 192, 3, 4),
    "l": (128, 256, 4, 4),
    "xl": (256, 512, 4, 4),  # the size-extrapolation size: wider than any training size
}
FAMILIES = [
    "llama",
    "qwen2",
    "qwen2-moe",
    "gpt2",
    "clip-vit",
    "siglip-vit",
    "vit",
    "llava-clip",
    "llava-siglip",
    "qwen2-vl",
]
HELDOUT_FAMILIES = ["gpt-neox", "opt", "dinov2", "llava-dinov2-phi"]
"""Architectures the zoo never trains on (leave-architecture-out evaluation): built the same way,
but none of their components (decoder, vision tower, projector) is a training family's."""
MODALITY = {
    "gpt-neox": "text",
    "opt": "text",
    "dinov2": "vision",
    "llava-dinov2-phi": "multimodal",
    "llama": "text",
    "qwen2": "text",
    "qwen2-moe": "text",
    "gpt2": "text",
    "clip-vit": "vision",
    "siglip-vit": "vision",
    "vit": "vision",
    "llava-clip": "multimodal",
    "llava-siglip": "multimodal",
    "qwen2-vl": "multimodal",
}


def model_names(heldout: bool = False) -> list[str]:
    """Every zoo model name, FAMILY-SIZE (with `heldout`, the held-out architectures' too)."""
    fams = FAMILIES + (HELDOUT_FAMILIES if heldout else [])
    return [f"{f}-{s}" for f in fams for s in SIZES]


def parse_model_name(name: str) -> tuple[str, str]:
    """'llama-s' -> ('llama', 's'); a clear error naming the valid choices otherwise."""
    fam, _, size = name.rpartition("-")
    if fam not in FAMILIES + HELDOUT_FAMILIES or size not in SIZES:
        raise ValueError(
            f"model: {name!r} is not a known model; use FAMILY-SIZE with FAMILY in {FAMILIES + HELDOUT_FAMILIES} "
            f"and SIZE in {list(SIZES)} (e.g. llama-s)"
        )
    return fam, size
