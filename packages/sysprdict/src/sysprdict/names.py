"""The zoo's model names (FAMILY-SIZE), without torch, so the command line parses them fast."""

from __future__ import annotations

__all__ = ["FAMILIES", "MODALITY", "SIZES", "model_names", "parse_model_name"]

# name -> (hidden, intermediate, layers, heads)
SIZES = {
    "xs": (32, 64, 1, 2),
    "s": (64, 128, 2, 4),
    "m": (96, 192, 3, 4),
    "l": (128, 256, 4, 4),
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
MODALITY = {
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


def model_names() -> list[str]:
    """Every zoo model name, FAMILY-SIZE."""
    return [f"{f}-{s}" for f in FAMILIES for s in SIZES]


def parse_model_name(name: str) -> tuple[str, str]:
    """'llama-s' -> ('llama', 's'); a clear error naming the valid choices otherwise."""
    fam, _, size = name.rpartition("-")
    if fam not in FAMILIES or size not in SIZES:
        raise ValueError(
            f"model: {name!r} is not a known model; use FAMILY-SIZE with FAMILY in {FAMILIES} "
            f"and SIZE in {list(SIZES)} (e.g. llama-s)"
        )
    return fam, size
