"""The masked diffusion LM: a bidirectional transformers decoder (Gemma3, Llama, Qwen2) and its vocabulary.

LLaDA-style: attention is bidirectional, one vocabulary entry is the mask token, training masks
answer tokens at a random ratio and the model predicts them all at once. LLaDA's architecture is
Llama's and Dream's is Qwen2's, so :func:`tiny_config` builds all three from transformers' own
classes; bicache runs them through their own ``forward`` with bidirectional masks and a
per-layer cache (:mod:`bicache.kvcache`). Real DLM checkpoints shipped as remote code (LLaDA,
Dream) load through :func:`load_local_dlm` (``trust_remote_code=True``, opt-in) and run the
no-cache decoder only, as their classes are not transformers' decoder layers.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import hwtopo

from .task import TaskSpec, Vocab

ARCHS = ("gemma3", "llama", "qwen2")  # tiny_config's architectures: Gemma3, LLaDA-shaped, Dream-shaped
LAYER_TYPES = ("full_attention", "sliding_attention")  # the attention kinds bicache's masks cover
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")  # the kernels that take bicache's explicit masks


def tiny_config(
    vocab_size: int,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    max_len: int = 256,
    attn_scalar: int = 2,
    local_layers: int = 0,
    window: int = 4,
    arch: str = "gemma3",
    kv_heads: int | None = None,
) -> PretrainedConfig:
    """A small bidirectional decoder config of ``arch`` (``gemma3``, ``llama``, ``qwen2``).

    ``llama`` is LLaDA's shape (multi-head attention, SwiGLU, RMSNorm, rotary), ``qwen2`` is
    Dream's (grouped-query attention with ``kv_heads`` key/value heads, biased q/k/v projections).
    Gemma3 only: the first ``local_layers`` layers are ``sliding_attention`` layers (bidirectional
    window: a token attends to tokens less than ``window`` positions away) and
    ``query_pre_attn_scalar = attn_scalar`` sharpens its RMS-normalised attention logits.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    if not 0 <= local_layers <= layers:
        raise ValueError(f"local_layers must lie in [0, layers={layers}], got {local_layers}")
    if local_layers and arch != "gemma3":
        raise ValueError(f"local_layers needs arch='gemma3' (sliding-window layers); {arch} has global layers only")
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads or heads,
        "max_position_embeddings": max_len,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 3,
        "tie_word_embeddings": True,
        "attn_implementation": "sdpa",
        # Llama and Qwen2 ignore the flag; bicache reads it to accept the model as a diffusion LM
        "use_bidirectional_attention": True,
    }
    if arch == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return Gemma3TextConfig(
        **common,
        head_dim=hidden // heads,
        query_pre_attn_scalar=attn_scalar,
        # Gemma3's global layers default to rope_theta 1e6: with 16-dim heads only one or two
        # frequencies then turn over ~100 positions, too coarse to find "the digit after a key".
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        layer_types=["sliding_attention"] * local_layers + ["full_attention"] * (layers - local_layers),
        sliding_window=window if local_layers else max_len,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )


_MODEL_CLASSES = {"gemma3": Gemma3ForCausalLM, "llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}


def decoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The model's decoder layers, checked to be layers bicache can cache; ValueError otherwise.

    A cacheable layer has a ``self_attn`` module with a ``layer_idx`` (its keys and values pass
    through the transformers Cache) and a layer type of :data:`LAYER_TYPES`; the model runs an
    attention kernel of :data:`ATTN_IMPLEMENTATIONS`, which takes bicache's bidirectional masks.
    """
    base = model.base_model
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{type(model).__name__}: bicache caches decoders whose layers sit in `.layers` "
            f"(LlamaModel, Qwen2Model, Gemma3TextModel); {type(base).__name__} has none"
        )
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not isinstance(getattr(attn, "layer_idx", None), int):
            raise ValueError(
                f"bicache cannot cache {type(layer).__name__} layers (layer {i} of {type(model).__name__}): "
                "they have no self-attention whose keys and values pass through the transformers Cache; "
                "cacheable layers are attention decoder layers such as LlamaDecoderLayer, "
                "Qwen2DecoderLayer, Gemma3DecoderLayer"
            )
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * len(layers)
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise ValueError(
                f"bicache cannot cache {type(layers[i]).__name__} layer {i}: its layer type {t!r} is not "
                f"one of {', '.join(LAYER_TYPES)}"
            )
    impl = model.config._attn_implementation
    if impl not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation {impl!r} cannot take bicache's bidirectional masks; "
            f"load the model with one of {', '.join(ATTN_IMPLEMENTATIONS)}"
        )
    return list(layers)


class DiffusionLM:
    """A model, its vocabulary and task spec; ``mask_id`` is the diffusion mask token."""

    def __init__(self, model: PreTrainedModel, vocab: Vocab, spec: TaskSpec) -> None:
        cfg = model.config
        if not getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError(
                "model config has use_bidirectional_attention=False (or unset); a diffusion LM needs True: "
                "set config.use_bidirectional_attention = True (bicache then runs every layer bidirectionally)"
            )
        self.layers = decoder_layers(model)
        if cfg.vocab_size < len(vocab):
            raise ValueError(f"model vocab_size {cfg.vocab_size} is smaller than the task vocabulary {len(vocab)}")
        self.model = model.eval()
        self.vocab = vocab
        self.spec = spec
        self.mask_id = vocab.mask_id

    @property
    def config(self) -> PretrainedConfig:
        return self.model.config

    @property
    def layer_types(self) -> list[str]:
        """Each layer's attention: ``full_attention`` or ``sliding_attention`` (checked in __init__)."""
        return getattr(self.model.config, "layer_types", None) or ["full_attention"] * self.num_layers

    @property
    def sliding_window(self) -> int:
        """Window of the sliding_attention layers (positions)."""
        window = self.model.config.sliding_window
        if window is None:
            raise ValueError("sliding_window: the model config has sliding_attention layers but no window")
        return window

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def max_length(self) -> int:
        return self.model.config.max_position_embeddings

    @classmethod
    def random(cls, spec: TaskSpec | None = None, seed: int = 0, arch: str = "gemma3", **cfg) -> DiffusionLM:
        """A randomly initialised model of ``arch`` (tests, mechanics); ``cfg`` goes to :func:`tiny_config`."""
        spec = spec or TaskSpec()
        vocab = Vocab(spec.n_keys, spec.value_digits)
        config = tiny_config(len(vocab), arch=arch, **cfg)
        torch.manual_seed(seed)
        return cls(_MODEL_CLASSES[arch](config), vocab, spec)

    def save(self, directory: str | Path) -> Path:
        """Save weights + config + spec atomically (a temp dir renamed into place)."""

        def fill(tmp: Path) -> None:
            self.model.save_pretrained(tmp)
            (tmp / "task.json").write_text(json.dumps(asdict(self.spec)))

        return hwtopo.atomic_dir(directory, fill)

    @classmethod
    def load(cls, directory: str | Path) -> DiffusionLM:
        directory = Path(directory)
        if not (directory / "task.json").exists():
            raise FileNotFoundError(f"{directory} holds no bicache checkpoint (task.json missing)")
        try:
            spec = TaskSpec(**json.loads((directory / "task.json").read_text(encoding="utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{directory / 'task.json'}: not a bicache task spec ({e})") from None
        # the class comes from config.json's model_type among transformers' own: no remote code runs
        model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
        return cls(model, Vocab(spec.n_keys, spec.value_digits), spec)


def load_local_dlm(path: str | Path, trust_remote_code: bool = False):
    """Load a real diffusion LM checkpoint (LLaDA, Dream) from a local directory.

    Returns ``(model, tokenizer)``; nothing is downloaded (``local_files_only``). Such models run the
    no-cache decoder of :mod:`bicache.diffusion` through their own ``forward``: the per-layer cache
    needs transformers' own decoder classes (a :class:`DiffusionLM` of Llama, Qwen2 or Gemma3). Their architecture
    is Python code inside the directory, which runs only with ``trust_remote_code=True``: pass it
    for a directory you trust, as for any code you run.
    """
    from transformers import AutoModel, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a local model directory (config.json missing)")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path / 'config.json'}: not a JSON model config ({e})") from None
    if isinstance(config, dict) and config.get("auto_map") and not trust_remote_code:
        raise PermissionError(
            f"{path} defines its model in Python files of its own (config.json auto_map); loading it "
            "runs that code: pass trust_remote_code=True only for a directory you trust"
        )
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    model = AutoModel.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    return model.eval(), tok
