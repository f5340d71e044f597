"""The masked diffusion LM: a bidirectional Gemma3 text model built from a local config.

LLaDA-style: attention is bidirectional (``use_bidirectional_attention=True``), one vocabulary entry
is the mask token, training masks answer tokens at a random ratio and the model predicts them all
at once. Real DLM checkpoints (LLaDA, Dream) in a local directory load through
:func:`load_local_dlm` (``trust_remote_code=True``, opt-in); the per-layer cache needs the Gemma3 layer layout, so
such checkpoints run the no-cache decoder only.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import hwtopo

from .task import TaskSpec, Vocab


def tiny_config(
    vocab_size: int,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    max_len: int = 256,
    attn_scalar: int = 2,
    local_layers: int = 0,
    window: int = 4,
) -> Gemma3TextConfig:
    """A small bidirectional Gemma3 config (no soft-capping).

    The first ``local_layers`` layers are Gemma3 ``sliding_attention`` layers (bidirectional window:
    a token attends to tokens less than ``window`` positions away, as Gemma3 interleaves local and
    global layers); the others use full attention.

    Gemma3 RMS-normalises queries and keys, so with the usual ``1/sqrt(head_dim)`` scaling a logit
    is at most ``sqrt(head_dim)`` (4 for 16 dims): too flat for a table lookup among ~100 positions.
    ``query_pre_attn_scalar = attn_scalar`` lets one position win the softmax.
    """
    if not 0 <= local_layers <= layers:
        raise ValueError(f"local_layers must lie in [0, layers={layers}], got {local_layers}")
    return Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        query_pre_attn_scalar=attn_scalar,
        # Gemma3's global layers default to rope_theta 1e6: with 16-dim heads only one or two
        # frequencies then turn over ~100 positions, too coarse to find "the digit after a key".
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        max_position_embeddings=max_len,
        layer_types=["sliding_attention"] * local_layers + ["full_attention"] * (layers - local_layers),
        sliding_window=window if local_layers else max_len,
        use_bidirectional_attention=True,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        tie_word_embeddings=True,
        # a config takes extra keyword arguments; its dataclass typing does not show them
        attn_implementation="sdpa",  # type: ignore[call-arg]
    )


class DiffusionLM:
    """A model, its vocabulary and task spec; ``mask_id`` is the diffusion mask token."""

    def __init__(self, model: Gemma3ForCausalLM, vocab: Vocab, spec: TaskSpec) -> None:
        cfg = model.config
        if not getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("model config has use_bidirectional_attention=False; a diffusion LM needs True")
        if cfg.layer_types is None or any(t not in ("full_attention", "sliding_attention") for t in cfg.layer_types):
            raise ValueError("layer_types must be full_attention or sliding_attention")
        if cfg.vocab_size < len(vocab):
            raise ValueError(f"model vocab_size {cfg.vocab_size} is smaller than the task vocabulary {len(vocab)}")
        self.model = model.eval()
        self.vocab = vocab
        self.spec = spec
        self.mask_id = vocab.mask_id

    @property
    def config(self) -> Gemma3TextConfig:
        return self.model.config

    @property
    def layer_types(self) -> list[str]:
        """Each layer's attention: ``full_attention`` or ``sliding_attention``."""
        types = self.model.config.layer_types
        assert types is not None  # checked in __init__
        return types

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
    def random(cls, spec: TaskSpec | None = None, seed: int = 0, **cfg) -> DiffusionLM:
        """A randomly initialised model (tests, mechanics)."""
        spec = spec or TaskSpec()
        vocab = Vocab(spec.n_keys, spec.value_digits)
        torch.manual_seed(seed)
        return cls(Gemma3ForCausalLM(tiny_config(len(vocab), **cfg)), vocab, spec)

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
        model = Gemma3ForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
        return cls(model, Vocab(spec.n_keys, spec.value_digits), spec)


def load_local_dlm(path: str | Path, trust_remote_code: bool = False):
    """Load a real diffusion LM checkpoint (LLaDA, Dream) from a local directory.

    Returns ``(model, tokenizer)``; nothing is downloaded (``local_files_only``). Such models run the
    no-cache decoder of :mod:`bicache.diffusion` through their own ``forward``. Their architecture
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
