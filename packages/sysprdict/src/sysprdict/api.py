"""Predict any transformers model: a `PreTrainedModel`, a `PretrainedConfig`, a local model
directory, a zoo name or an already made `Decomposition`.

A configuration or a directory is built on the meta device (`torch.device("meta")`: shapes and
dtypes, no storage; accelerate's `init_empty_weights` does the same but is not a dependency), so
a 70B configuration is predicted without allocating its weights.  Tracing then runs on fake
tensors (`layers.decompose`).  A module the decomposition does not know is refused with one error
naming its type, rather than silently costed as nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from .layers import Decomposition, decompose
from .memory import MemoryPrediction, TrainSetup, with_overhead
from .memory import predict_memory as _tensor_peak
from .zoo import Shape, ZooModel

log = logging.getLogger(__name__)

__all__ = ["UnsupportedModelError", "load_model", "predict_memory", "predict_time"]


class UnsupportedModelError(ValueError):
    """A model sysprdict cannot decompose (names the module type or the model class)."""


def _config_from_dir(path: Path):
    import transformers as T

    if not (path / "config.json").is_file():
        raise UnsupportedModelError(f"model: directory {str(path)!r} has no config.json (a transformers model dir)")
    # local files only, and never the model's own code (trust_remote_code stays off)
    return T.AutoConfig.from_pretrained(str(path), local_files_only=True)


def _model_class(cfg) -> Any:
    """The transformers class that trains `cfg`: its declared architecture when transformers has it,
    else the causal-LM, image-text or image-classification auto class that accepts it."""
    import transformers as T

    for name in getattr(cfg, "architectures", None) or []:
        cls = getattr(T, name, None)
        if cls is not None:
            return cls
    autos = (T.AutoModelForCausalLM, T.AutoModelForImageTextToText, T.AutoModelForImageClassification)
    for auto in autos:
        if type(cfg) in auto._model_mapping:
            return auto
    raise UnsupportedModelError(
        f"model: no trainable transformers class for config {type(cfg).__name__} "
        "(supported: causal language models, LLaVA-style image-text models, image classifiers)"
    )


def _build_meta(cfg):
    import torch

    cls = _model_class(cfg)
    with torch.device("meta"):
        return cls.from_config(cfg) if hasattr(cls, "from_config") else cls(cfg)


def _vision_geometry(cfg, image_size: int | None) -> tuple[int, int]:
    vc = getattr(cfg, "vision_config", None) or cfg
    patch = int(getattr(vc, "patch_size", 0) or 0)
    side = int(image_size or getattr(vc, "image_size", 0) or 0)
    if not patch or not side:
        raise UnsupportedModelError(f"model: {type(cfg).__name__} has no patch_size/image_size to shape images by")
    return side, patch


def _wrap(module, image_size: int | None) -> ZooModel:
    """A ZooModel view of a transformers model: how to make its batch and trace it."""
    cfg = module.config
    cls = type(module).__name__
    name = getattr(cfg, "name_or_path", "") or cfg.model_type
    text_cfg = getattr(cfg, "text_config", None) or cfg
    vocab = int(getattr(text_cfg, "vocab_size", 0) or 0)
    if getattr(cfg, "vision_config", None) is not None and getattr(cfg, "text_config", None) is not None:
        inner = getattr(module, "model", module)
        if not (hasattr(inner, "vision_tower") and hasattr(inner, "multi_modal_projector")):
            raise UnsupportedModelError(
                f"model: {cls} is an image-text model sysprdict cannot stage (LLaVA-style only)"
            )
        side, patch = _vision_geometry(cfg, image_size)
        token = int(getattr(cfg, "image_token_index", getattr(cfg, "image_token_id", vocab - 1)))
        return ZooModel(name, "llava", "", "multimodal", module, side, vocab, patch=patch, image_token=token)
    if cls.endswith("ForImageClassification"):
        side, patch = _vision_geometry(cfg, image_size)
        return ZooModel(name, cfg.model_type, "", "vision", module, side, num_classes=cfg.num_labels, patch=patch)
    if vocab and module.get_output_embeddings() is not None:
        return ZooModel(name, cfg.model_type, "", "text", module, 0, vocab)
    raise UnsupportedModelError(f"model: {cls} is neither a causal LM, a LLaVA-style model nor an image classifier")


def load_model(model: Any, image_size: int | None = None) -> ZooModel:
    """A ZooModel for `model`: a ZooModel, a zoo name ("llama-s"), a local model directory, a
    `PretrainedConfig` (built on the meta device) or a `PreTrainedModel` (used as is)."""
    import transformers as T

    from .zoo import build

    if isinstance(model, ZooModel):
        return model
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if path.is_dir():
            return _wrap(_build_meta(_config_from_dir(path)), image_size)
        try:
            return build(str(model), image_size=image_size or 32)
        except ValueError:
            raise UnsupportedModelError(
                f"model: {str(model)!r} is neither a local model directory nor a zoo model (FAMILY-SIZE)"
            ) from None
    if isinstance(model, T.PretrainedConfig):
        return _wrap(_build_meta(model), image_size)
    if isinstance(model, T.PreTrainedModel):
        return _wrap(model, image_size)
    raise UnsupportedModelError(
        f"model: {type(model).__name__} is not a PreTrainedModel, PretrainedConfig, model directory or zoo name"
    )


def _decompose(model: Any, batch: int, seq_len: int, image_size: int | None, precision: str) -> Decomposition:
    if isinstance(model, Decomposition):
        return model
    zm = load_model(model, image_size)
    d = decompose(zm, Shape(batch, seq_len, zm.image_size), precision)
    if d.unknown:
        names = ", ".join(sorted(d.unknown))
        raise UnsupportedModelError(
            f"model: sysprdict cannot decompose module type {names} (no known layer kind; it issues ops whose "
            "memory and time it would not know how to attribute)"
        )
    return d


def predict_memory(
    model: Any,
    setup: TrainSetup | None = None,
    *,
    batch: int = 1,
    seq_len: int = 512,
    image_size: int | None = None,
    precision: str = "fp32",
    overhead: Any = None,
) -> MemoryPrediction:
    """Predicted peak training memory of `model` (a Decomposition, ZooModel, zoo name, model
    directory, PretrainedConfig or PreTrainedModel) for one step of `batch` x `seq_len` tokens.
    Without `overhead` the peak is the tensors' own; with a fitted `overhead.RuntimeOverhead` (or
    the path of one saved by `sysprdict calibrate`) it is the process's real peak."""
    from .overhead import RuntimeOverhead

    d = _decompose(model, batch, seq_len, image_size, precision)
    pred = _tensor_peak(d, setup or TrainSetup())
    if overhead is None:
        return pred
    if isinstance(overhead, (str, os.PathLike)):
        overhead = RuntimeOverhead.load(overhead)
    return with_overhead(pred, d, overhead)


def predict_time(
    model: Any,
    predictor: Any,
    *,
    batch: int = 1,
    seq_len: int = 512,
    image_size: int | None = None,
    precision: str = "fp32",
    optimizer: str = "adamw",
    world_size: int = 1,
    bandwidth_bytes_per_s: float | None = None,
) -> float:
    """Predicted step time (s) of `model` with a fitted `timepred.TimePredictor` (train one on
    measured rows: `TimePredictor().fit(...)`, or `sysprdict predict --dataset`)."""
    from .timepred import TimePredictor

    if not isinstance(predictor, TimePredictor):
        raise ValueError(f"predictor: {type(predictor).__name__} is not a fitted sysprdict TimePredictor")
    d = _decompose(model, batch, seq_len, image_size, precision)
    return predictor.predict_step(d, world_size, bandwidth_bytes_per_s=bandwidth_bytes_per_s, optimizer=optimizer)
