"""Apply an uneven partition to a real transformers decoder (Llama, Qwen2, Mistral-like families).

Modules are chosen by name from the model's ``base_model_tp_plan`` ("colwise"/"rowwise" patterns
such as ``layers.*.self_attn.q_proj``), replaced by :mod:`xronos.layers` shards cut from the full
weights, and the attention modules' head counts are set to the rank's share. One ``copy_to_tp`` per
attention/MLP block input replaces one per projection, so the backward pass does a single
all-reduce per block. :func:`gather_state_dict` reverses it (LoRA merged on request) into a full
state dict that ``save_pretrained`` can write.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hwtopo

from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_uneven,
    merged_weight,
    vocab_parallel_cross_entropy,
)
from .partition import ModelShape, Partition, PartitionError

__all__ = [
    "tiny_config",
    "build_model",
    "tp_plan",
    "shard_model",
    "lm_loss",
    "gather_state_dict",
    "save_full",
    "enable_lora",
    "VOCAB_PARALLEL",
]

log = logging.getLogger(__name__)

_DEFAULT_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}

FAMILIES = ("llama", "qwen2", "mistral")
VOCAB_PARALLEL = ("none", "head", "both")


def tiny_config(family: str = "llama", **overrides):
    """A small config of a real architecture (byte-level vocabulary of 256), built locally."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    base: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    base.update(overrides)
    if family == "llama":
        return LlamaConfig(**base)
    if family == "qwen2":
        return Qwen2Config(**base)
    if family == "mistral":
        return MistralConfig(**base)
    raise PartitionError(f"family must be one of {', '.join(FAMILIES)}, not {family!r}")


def build_model(config, seed: int = 0, init: bool = True):
    """The full model from a config with a fixed seed (identical on every rank), fp32, sdpa attention.

    ``init=False`` skips the random initialisation of the weights (buffers such as the rotary
    frequencies are still computed): for a caller that overwrites every parameter, e.g. a reshard.
    """
    import contextlib

    from transformers import AutoModelForCausalLM

    skip: contextlib.AbstractContextManager = contextlib.nullcontext()
    if not init:
        try:
            from transformers.initialization import no_init_weights
        except ImportError:  # older transformers, where mypy's installed one has no such name
            from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined,no-redef]
        skip = no_init_weights()
    torch.manual_seed(seed)
    with skip:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if not init:
        model.tie_weights()  # skipped with the initialisation: a tied LM head would stay a separate tensor
    return model


def tp_plan(model) -> dict[str, str]:
    """Module-name patterns (relative to the top model) -> "colwise"/"rowwise"."""
    cfg = model.config
    plan = getattr(cfg, "base_model_tp_plan", None) or _DEFAULT_PLAN
    prefix = getattr(model, "base_model_prefix", "model")
    out = {}
    for pat, style in plan.items():
        kind = "colwise" if "colwise" in style else "rowwise" if "rowwise" in style else None
        if kind is not None:
            out[f"{prefix}.{pat}" if hasattr(model, prefix) else pat] = kind
    return out


def _sizes_for(name: str, part: Partition) -> tuple[int, ...]:
    leaf = name.rsplit(".", 1)[-1]
    if "attn" in name:
        return part.kv_sizes if leaf in ("k_proj", "v_proj") else part.q_sizes
    if "mlp" in name:
        return part.mlp_sizes
    raise PartitionError(f"module {name!r} is in the TP plan but is neither attention nor MLP; cannot size it")


def _copy_input_hook(group, tag: str = ""):
    def hook(module, args, kwargs):
        if args:
            args = (copy_to_tp(args[0], group, tag), *args[1:])
        elif "hidden_states" in kwargs:
            kwargs = dict(kwargs, hidden_states=copy_to_tp(kwargs["hidden_states"], group, tag))
        return args, kwargs

    return hook


def check_partition(config, part: Partition, world_size: int) -> None:
    """The partition must describe this model config and this world size (one clear error otherwise)."""
    shape = ModelShape.from_config(config, mlp_block=part.shape.mlp_block)
    s = part.shape
    if (s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size) != (
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.intermediate_size,
    ):
        raise PartitionError(
            f"the partition was made for {s.num_heads} heads / {s.num_kv_heads} KV heads / intermediate "
            f"{s.intermediate_size}, but the model has {shape.num_heads} / {shape.num_kv_heads} / "
            f"{shape.intermediate_size}"
        )
    if part.world_size != world_size:
        raise PartitionError(f"the partition has {part.world_size} ranks but the world size is {world_size}")


def shard_model(model, part: Partition, rank: int, group=None, vocab_parallel: str = "none"):
    """Replace the planned projections of ``model`` (in place) by this rank's shards; returns the model.

    ``vocab_parallel``: "none" keeps the embedding and LM head replicated; "head" splits the LM head
    by vocabulary (uneven, :meth:`Partition.vocab_sizes`; the loss is then
    :func:`xronos.layers.vocab_parallel_cross_entropy` on this rank's logits, see :func:`lm_loss`);
    "both" splits the input embedding too.
    """
    import torch.distributed as dist

    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    check_partition(model.config, part, world)
    if vocab_parallel not in VOCAB_PARALLEL:
        raise PartitionError(f"vocab_parallel must be one of {', '.join(VOCAB_PARALLEL)}, not {vocab_parallel!r}")
    plan = tp_plan(model)
    name_of = {id(m): n for n, m in model.named_modules()}
    parents = {}
    replaced = 0
    for name, mod in list(model.named_modules()):
        style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(name, pat)), None)
        if style is None or not isinstance(mod, nn.Linear):
            continue
        sizes = _sizes_for(name, part)
        parent_name, leaf = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        new: ColumnParallelLinear | RowParallelLinear
        if style == "colwise":
            new = ColumnParallelLinear.from_linear(mod, sizes, rank, group, sync_input_grad=False)
            parents[parent_name] = parent
        else:
            new = RowParallelLinear.from_linear(mod, sizes, rank, group)
        new.xronos_name = name
        new.tag = "attn" if "attn" in name else "mlp"
        setattr(parent, leaf, new)
        replaced += 1
    if replaced == 0:
        raise PartitionError("no module of the model matched its tensor-parallel plan; is it a decoder LM?")
    for parent in parents.values():
        parent.register_forward_pre_hook(
            _copy_input_hook(group, "attn" if "attn" in name_of[id(parent)] else "mlp"), with_kwargs=True
        )
        if hasattr(parent, "q_proj"):  # attention: this rank's head counts
            parent.num_heads = part.q_heads[rank]
            parent.num_key_value_heads = part.kv_heads[rank]
            if part.kv_heads[rank]:
                parent.num_key_value_groups = part.q_heads[rank] // part.kv_heads[rank]
    model.xronos_vocab = None
    if vocab_parallel != "none":
        vocab = model.config.vocab_size
        sizes = part.vocab_sizes(vocab)
        if getattr(model.config, "tie_word_embeddings", False):
            raise PartitionError("vocab_parallel needs untied embeddings (tie_word_embeddings=False)")
        head = ColumnParallelLinear.from_linear(model.lm_head, sizes, rank, group, sync_input_grad=True)
        head.tag, head.xronos_name, head.xronos_no_lora = "head", "lm_head", True
        model.lm_head = head
        if vocab_parallel == "both":
            base = model.get_submodule(getattr(model, "base_model_prefix", "model"))
            base.embed_tokens = VocabParallelEmbedding.from_embedding(base.embed_tokens, sizes, rank, group)
        model.xronos_vocab = (sum(sizes[:rank]), sizes)
    model.xronos_partition = part
    model.xronos_rank = rank
    model.xronos_group = group
    return model


def lm_loss(model, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` for ``ids``; vocab-parallel when the head is split."""
    import torch.nn.functional as F

    shifted, target = logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    vocab = getattr(model, "xronos_vocab", None)
    if vocab is None:
        return F.cross_entropy(shifted.float(), target)
    return vocab_parallel_cross_entropy(shifted, target, vocab[0], model.xronos_group).mean()


def enable_lora(model, r: int = 8, alpha: float = 16.0, seed: int = 0) -> list[nn.Parameter]:
    """Freeze the model and add LoRA adapters to every sharded projection; returns the trainable params."""
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    params = []
    for _, mod in model.named_modules():
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) and not getattr(mod, "xronos_no_lora", False):
            mod.enable_lora(r, alpha, gen)
            assert mod.lora_A is not None and mod.lora_B is not None  # just enabled
            params += [mod.lora_A, mod.lora_B]
    return params


def gather_state_dict(model, group=None, merge_lora: bool = True) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict, on every rank. With ``merge_lora`` adapters are folded in."""
    out = {}
    sharded = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            sharded[name] = mod
    for key, t in model.state_dict().items():
        mod_name, _, pname = key.rpartition(".")
        if mod_name not in sharded:
            out[key] = t.detach().clone()
    for name, mod in sharded.items():
        dim = mod.shard_dim
        out[f"{name}.weight"] = gather_uneven(merged_weight(mod) if merge_lora else mod.weight, mod.sizes, dim, group)
        if mod.bias is not None:
            out[f"{name}.bias"] = (
                gather_uneven(mod.bias, mod.sizes, 0, group) if dim == 0 else mod.bias.detach().clone()
            )
    return out


def save_full(model, path: str | os.PathLike, group=None, rank: int = 0) -> Path | None:
    """Gather the full weights and write a ``save_pretrained`` directory from rank 0, whole or not at all."""
    state = gather_state_dict(model, group)
    if rank != 0:
        return None
    full = build_model(model.config)
    missing, unexpected = full.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"gathered state dict does not match the model: missing {missing}, unexpected {unexpected}")
    return hwtopo.atomic_dir(path, full.save_pretrained)
