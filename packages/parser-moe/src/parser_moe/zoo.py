"""The trained tiny MoEs that ship with the package, one per training seed, and the command that
regenerates them.

Each checkpoint is the tiny Qwen2-MoE of :mod:`parser_moe.tinymoe` trained with one seed (init and
data order), stored as float16 safetensors (about 2.3 MB each) and loaded in float32, so the bench
and demo compare methods across independently trained models without training anything.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, replace
from pathlib import Path

import torch

import hwtopo

from .tinymoe import TinyMoEConfig, train

log = logging.getLogger(__name__)

ZOO_DIR = Path(__file__).parent / "checkpoints"
SEEDS = (0, 1, 2)


def checkpoint_dir(seed: int, root: str | Path | None = None) -> Path:
    """Where the tiny MoE trained with ``seed`` lives (``root`` defaults to the package's own folder)."""
    return Path(root or ZOO_DIR) / f"tinymoe-seed{int(seed)}"


def available_seeds(root: str | Path | None = None) -> list[int]:
    """Seeds with a complete checkpoint under ``root``."""
    return [s for s in SEEDS if (checkpoint_dir(s, root) / "model.safetensors").is_file()]


def load_seed(seed: int, root: str | Path | None = None) -> tuple[torch.nn.Module, dict]:
    """The shipped tiny MoE of ``seed`` in float32, and its training record (``info``)."""
    from transformers import AutoModelForCausalLM

    path = checkpoint_dir(seed, root)
    if not (path / "model.safetensors").is_file():
        have = available_seeds(root)
        raise FileNotFoundError(
            f"no tiny MoE checkpoint for seed {seed} under {path.parent} (have seeds {have}); "
            "regenerate them with `parser-moe train`"
        )
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    info = json.loads((path / "train.json").read_text())
    info.update(path=str(path), cached=True, seed=seed)
    return model, info


def train_seed(seed: int, root: str | Path | None = None, steps: int | None = None, progress: bool = True) -> Path:
    """Train the tiny MoE with ``seed`` and write it (float16 safetensors + train.json) atomically."""
    cfg = replace(TinyMoEConfig(), seed=int(seed))
    if steps is not None:
        cfg = replace(cfg, steps=int(steps))
    log.info("training the tiny MoE, seed %d, %d steps", cfg.seed, cfg.steps)
    model, info = train(cfg, progress=progress)
    info["config"] = asdict(cfg)
    info["stored_dtype"] = "float16"

    def fill(d: Path) -> None:
        # transformers wraps PreTrainedModel.to with functools.wraps, whose typing binds the dtype to self
        model.to(torch.float16).save_pretrained(str(d))  # type: ignore[arg-type]
        (d / "train.json").write_text(json.dumps(info, indent=2) + "\n")

    return hwtopo.atomic_dir(checkpoint_dir(seed, root), fill)
