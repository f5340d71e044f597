"""Compressed models as ordinary transformers models: ``save_pretrained`` / ``from_pretrained``.

:class:`ParserMoeConfig` (``model_type = "parser_moe"``) holds the uncompressed model's config and
the shapes of each compressed experts collection; :class:`ParserMoeForCausalLM` rebuilds the
uncompressed architecture from it, puts empty compressed modules where the experts were, and
forwards to it. Importing this module registers both with ``AutoConfig`` and
``AutoModelForCausalLM``, so ``AutoModelForCausalLM.from_pretrained(dir)`` loads a compressed
model once ``parser_moe.hf`` (or ``parser_moe.ParserMoeForCausalLM``) has been imported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from .compressed import compressed_layers, install_empty


class ParserMoeConfig(PretrainedConfig):
    """Config of a compressed MoE: ``base_config`` (the original model's config as a dict) and
    ``compressed`` (experts-collection path -> its shapes, layout and dtype)."""

    model_type = "parser_moe"

    def __init__(self, base_config: dict | None = None, compressed: dict | None = None, **kwargs: Any):
        self.base_config = dict(base_config or {})
        self.compressed = dict(compressed or {})
        super().__init__(**kwargs)

    def inner_config(self) -> PretrainedConfig:
        """The uncompressed model's config object."""
        cfg = dict(self.base_config)
        model_type = cfg.pop("model_type", None)
        if not model_type:
            raise ValueError("parser_moe config: base_config has no model_type; not written by parser-moe")
        return AutoConfig.for_model(model_type, **cfg)


class ParserMoeForCausalLM(PreTrainedModel):
    """A causal LM whose routed experts are parser-moe compressed modules (``self.inner`` is the model)."""

    config_class = ParserMoeConfig
    base_model_prefix = "inner"
    _supports_attention_backend = True

    def __init__(self, config: ParserMoeConfig):
        super().__init__(config)
        self.inner = AutoModelForCausalLM.from_config(config.inner_config())
        install_empty(self.inner, config.compressed)
        tied = getattr(self.inner, "_tied_weights_keys", None)
        if isinstance(tied, dict):
            self._tied_weights_keys = {f"inner.{k}": f"inner.{v}" for k, v in tied.items()}
        self.post_init()

    @classmethod
    def wrap(cls, model: nn.Module) -> ParserMoeForCausalLM:
        """Wrap a model returned by :func:`parser_moe.compress_model`, sharing its tensors."""
        layers = compressed_layers(model)
        if not layers:
            raise ValueError("model has no compressed experts; call compress_model first")
        base_config = getattr(model, "config", None)
        if not isinstance(base_config, PretrainedConfig):
            raise ValueError(f"model {type(model).__name__} has no transformers config to save beside its experts")
        config = ParserMoeConfig(base_config=base_config.to_dict(), compressed=layers)
        with torch.device("meta"):  # the fresh inner model is replaced at once: allocate nothing
            out = cls(config)
        out.inner = model
        return out

    def _init_weights(self, module: nn.Module) -> None:
        """Weights come from the checkpoint; the inner model initialises its own fresh modules."""

    def get_input_embeddings(self) -> nn.Module:
        return self.inner.get_input_embeddings()

    def forward(self, *args: Any, **kwargs: Any):
        return self.inner(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any):
        return self.inner.generate(*args, **kwargs)


AutoConfig.register(ParserMoeConfig.model_type, ParserMoeConfig, exist_ok=True)
AutoModelForCausalLM.register(ParserMoeConfig, ParserMoeForCausalLM, exist_ok=True)
