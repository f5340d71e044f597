"""Pretrained checkpoints: a local transformers directory split into uneven tensor-parallel shards,
and a LoRA-merged checkpoint written back.

Loading never holds the whole model on a rank: the model is built on the meta device (no storage),
its planned projections are replaced by this rank's shards (still meta), and then every parameter is
created from only the rows or columns this rank holds, read with ``safe_open(...).get_slice(name)``
from the safetensors files. Saving goes the other way one decoder layer at a time: each rank folds
its LoRA adapters into its own shard, the shards are gathered to rank 0 only, and rank 0 writes one
safetensors file per layer, the index and ``config.json`` into a temporary directory that then
replaces the target whole, so ``AutoModelForCausalLM.from_pretrained`` loads it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .data import ByteCorpus, load_text
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, gather_uneven_many, merged_weight
from .partition import ModelShape, Partition, PartitionError
from .shard import build_model, shard_model

__all__ = [
    "SUPPORTED",
    "PretrainedError",
    "Checkpoint",
    "LoadStats",
    "inspect_checkpoint",
    "model_shape",
    "load_sharded",
    "save_merged",
    "check_finetune",
    "finetune_pretrained",
    "finetune_pretrained_rank",
    "pretrained_corpus",
]

log = logging.getLogger(__name__)

# model_type values whose decoder blocks (q/k/v/o attention, gate/up/down MLP, RMSNorm) shard_model splits
SUPPORTED = ("llama", "qwen2", "mistral")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class PretrainedError(PartitionError):
    """A model directory xronos cannot shard (missing files, unsupported architecture, bad tensors)."""


@dataclass(frozen=True)
class Checkpoint:
    """A local model directory: its config and which safetensors file holds each tensor."""

    path: Path
    config: Any
    weight_map: dict[str, str]

    @property
    def files(self) -> list[Path]:
        return [self.path / f for f in sorted(set(self.weight_map.values()))]

    def file_bytes(self) -> int:
        """Size of the safetensors files on disk (what loading the whole model would read)."""
        return sum(f.stat().st_size for f in self.files)


@dataclass
class LoadStats:
    """What one rank read and holds: bytes of tensor data read, parameters held, largest read."""

    bytes_read: int = 0
    params_held: int = 0
    largest_read: tuple[str, tuple[int, ...]] = ("", ())
    reads: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tensor name -> shape read

    def describe(self) -> dict:
        return {"bytes_read": self.bytes_read, "params_held": self.params_held, "largest_read": list(self.largest_read)}


def _listing(path: Path) -> str:
    names = sorted(p.name for p in path.iterdir())
    return ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "") if names else "nothing"


def _keys_of(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return list(f.keys())


def _weight_map(path: Path) -> dict[str, str]:
    """tensor name -> file, from the index of a sharded checkpoint or from the files themselves."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise PretrainedError(f"{index} is not a safetensors index (no valid 'weight_map': {e})") from None
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise PretrainedError(f"{index} names shard files that are not in {path}: {', '.join(missing)}")
        return dict(weight_map)
    files = [path / SINGLE] if (path / SINGLE).is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise PretrainedError(
            f"{path} holds no safetensors weights ({SINGLE} or {INDEX}); found: {_listing(path)}. "
            "xronos reads safetensors only (a pickled pytorch_model.bin could run code when loaded)"
        )
    return {k: f.name for f in files for k in _keys_of(f)}


def inspect_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The config and tensor index of a local model directory; one clear error for what cannot load."""
    p = Path(path)
    if not p.is_dir():
        raise PretrainedError(f"model directory {str(p)!r} does not exist or is not a directory")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise PretrainedError(f"{p} has no config.json; found: {_listing(p)}")
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise PretrainedError(f"{cfg_file} is not valid JSON ({e})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in SUPPORTED:
        archs = raw.get("architectures") if isinstance(raw, dict) else None
        raise PretrainedError(
            f"{cfg_file}: model_type {model_type!r} (architectures {archs}) is not supported; "
            f"xronos shards model_type {', '.join(SUPPORTED)}"
        )
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(p, local_files_only=True)
    return Checkpoint(p, config, _weight_map(p))


def model_shape(config, mlp_block: int = 16) -> ModelShape:
    """The partition shape of a pretrained config; the MLP block shrinks to a divisor of its width."""
    return ModelShape.from_config(config, mlp_block=math.gcd(config.intermediate_size, mlp_block))


def _index_of(mod: nn.Module, pname: str) -> tuple[slice, ...]:
    """Which part of the full tensor ``mod.<pname>`` holds on this rank (all of it when unsharded)."""
    everything = (slice(None),)
    if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
        n = mod.sizes[mod.rank]
        return (slice(mod.shard_offset, mod.shard_offset + n),)
    if isinstance(mod, RowParallelLinear) and pname == "weight":
        return (slice(None), slice(mod.shard_offset, mod.shard_offset + mod.in_features))
    return everything


class _Reader:
    """Open safetensors files (once each) and read slices of tensors, counting the bytes read."""

    def __init__(self, ckpt: Checkpoint, stats: LoadStats):
        self.ckpt, self.stats = ckpt, stats
        self.handles: dict[str, Any] = {}

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        from safetensors import safe_open

        fname = self.ckpt.weight_map.get(key)
        if fname is None:
            raise PretrainedError(f"{self.ckpt.path} has no tensor {key!r}, which the {self.model_type} model needs")
        if fname not in self.handles:
            self.handles[fname] = safe_open(self.ckpt.path / fname, "pt")
        t = self.handles[fname].get_slice(key)[index]
        nbytes = t.numel() * t.element_size()
        self.stats.bytes_read += nbytes
        self.stats.reads[key] = tuple(t.shape)
        if nbytes > math.prod(self.stats.largest_read[1]) * t.element_size():
            self.stats.largest_read = (key, tuple(t.shape))
        return t

    @property
    def model_type(self) -> str:
        return self.ckpt.config.model_type


def _materialise(model: nn.Module, ckpt: Checkpoint) -> LoadStats:
    """Replace every meta parameter by a CPU one made from this rank's slice of the checkpoint."""
    stats = LoadStats()
    reader = _Reader(ckpt, stats)
    done: dict[int, nn.Parameter] = {}  # a tied parameter (embedding = LM head) is read once
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                key = f"{mod_name}.{pname}" if mod_name else pname
                t = reader.read(key, _index_of(mod, pname))
                if tuple(t.shape) != tuple(p.shape):
                    raise PretrainedError(
                        f"{ckpt.path}: tensor {key!r} gives a slice of shape {tuple(t.shape)} where this rank's "
                        f"shard needs {tuple(p.shape)}; does config.json describe these weights?"
                    )
                new = nn.Parameter(t.to(p.dtype), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)  # keeps xronos' shard flags (clipping, partial gradients)
                done[id(p)] = new
                stats.params_held += new.numel()
            mod._parameters[pname] = done[id(p)]
    return stats


def _rebuild_buffers(model: nn.Module) -> None:
    """Buffers computed from the config (rotary frequencies) are made again on the CPU."""
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            if not hasattr(mod, "inv_freq"):
                raise PretrainedError(f"module {name!r} has buffers that are neither weights nor rotary frequencies")
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name), leaf, type(mod)(config=model.config))


def load_sharded(
    path: str | os.PathLike | Checkpoint,
    part: Partition,
    rank: int,
    group=None,
    vocab_parallel: str = "none",
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, LoadStats]:
    """This rank's shard of the pretrained model in ``path`` under ``part``, and what loading it read.

    Only this rank's rows/columns of every sharded weight are read; replicated weights (embedding,
    norms, an unsplit LM head) are read whole. Weights are cast to ``dtype``.
    """
    ckpt = path if isinstance(path, Checkpoint) else inspect_checkpoint(path)
    with torch.device("meta"):
        model = build_model(ckpt.config, init=False)
        shard_model(model, part, rank, group, vocab_parallel)
    if dtype != torch.float32:
        model.to(dtype)
    stats = _materialise(model, ckpt)
    _rebuild_buffers(model)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise PretrainedError(f"{ckpt.path}: nothing loaded into {', '.join(left[:5])}")
    log.info("rank %d read %d bytes of %d for its shard", rank, stats.bytes_read, ckpt.file_bytes())
    return model, stats


def _layer_of(key: str) -> int:
    """The decoder layer a state-dict key belongs to (-1 for the embedding, final norm and LM head)."""
    parts = key.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else -1


_Entry = tuple[str, nn.Module, str, int, tuple[int, ...]]  # key, module, parameter, shard dim (-1: whole), sizes


def _save_entries(model: nn.Module) -> list[list[_Entry]]:
    """What to save, grouped by decoder layer (-1: embedding, final norm, LM head), without any data."""
    seen: set[int] = set()
    groups: dict[int, list[_Entry]] = {}
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen or pname.startswith("lora_"):
                continue  # a tied weight is saved once; adapters are folded into their weight
            seen.add(id(p))
            key = f"{mod_name}.{pname}" if mod_name else pname
            dim = -1
            sizes: tuple[int, ...] = ()
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
                if pname == "weight":
                    dim, sizes = mod.shard_dim, mod.sizes
                elif isinstance(mod, ColumnParallelLinear):  # a row layer's bias is whole on every rank
                    dim, sizes = 0, mod.sizes
            groups.setdefault(_layer_of(key), []).append((key, mod, pname, dim, sizes))
    return [groups[k] for k in sorted(groups)]


def _local(mod: nn.Module, pname: str) -> torch.Tensor:
    """This rank's tensor to save: a sharded weight with its LoRA adapter folded in, else the parameter."""
    if pname == "weight" and isinstance(mod, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
        return merged_weight(mod)
    return getattr(mod, pname).detach()


def _write_layers(model: nn.Module, group, directory: Path | None) -> None:
    """Gather each layer's tensors to rank 0 (collective, every rank calls it); rank 0 writes them.
    Merged shards are made one layer at a time too, so saving adds at most one layer to any rank."""
    from safetensors.torch import save_file

    entries = _save_entries(model)
    weight_map, total = {}, 0
    for i, entry in enumerate(entries):
        sharded = [(_local(mod, pname), d, s) for _, mod, pname, d, s in entry if d >= 0]
        full = iter(gather_uneven_many(sharded, group, dst=0))
        if directory is None:
            continue
        tensors = {k: (next(full) if d >= 0 else _local(mod, p)).contiguous() for k, mod, p, d, _ in entry}
        fname = f"model-{i + 1:05d}-of-{len(entries):05d}.safetensors"
        save_file(tensors, directory / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if directory is not None:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        model.config.save_pretrained(directory)  # type: ignore[union-attr,operator]  # a transformers model


def save_merged(model: nn.Module, path: str | os.PathLike, group=None, rank: int = 0) -> Path | None:
    """Write the model (LoRA merged into the base weights) as a ``from_pretrained`` directory.

    Every rank of ``group`` calls it; the shards are gathered to rank 0 one layer at a time, so no
    rank other than 0 ever holds a full weight, and rank 0 at most one layer's. Rank 0 returns the
    directory, written atomically (a temporary sibling renamed over ``path``); others return None.
    """
    import hwtopo

    if rank != 0:
        _write_layers(model, group, None)
        return None
    return hwtopo.atomic_dir(path, lambda tmp: _write_layers(model, group, tmp))


def split_vocab(config, vocab_parallel: str) -> str:
    """``vocab_parallel`` for this model: "none" when its LM head shares the embedding's weight (as
    small Qwen2 models do), since a split head would need its own copy."""
    if vocab_parallel != "none" and getattr(config, "tie_word_embeddings", False):
        log.warning("the model ties its LM head to the embedding: both stay replicated (vocab_parallel none)")
        return "none"
    return vocab_parallel


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(ckpt: Checkpoint) -> bool:
    return any((ckpt.path / f).is_file() for f in TOKENIZER_FILES)


def pretrained_corpus(ckpt: Checkpoint, cfg) -> ByteCorpus:
    """The training text (``cfg.data`` or the stdlib sources) as the model's own tokens when its
    directory has a tokenizer, else as bytes (token ids 0-255)."""
    text = load_text(cfg.data, cfg.max_bytes)
    if not has_tokenizer(ckpt):
        return ByteCorpus(text, cfg.seq_len, cfg.seed)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt.path, local_files_only=True)
    ids = torch.tensor(tok(text.decode("utf-8", errors="replace"))["input_ids"], dtype=torch.long)
    if len(ids) and int(ids.max()) >= ckpt.config.vocab_size:
        raise PretrainedError(
            f"{ckpt.path}: its tokenizer gives token id {int(ids.max())}, beyond the model's vocab_size "
            f"{ckpt.config.vocab_size}; the tokenizer does not belong to these weights"
        )
    return ByteCorpus(ids, cfg.seq_len, cfg.seed)


def finetune_pretrained_rank(
    rank: int, world: int, model_dir: str, cfg_dict: dict, mode: str, save_dir: str | None, memory_bytes
) -> dict:
    """One rank of ``xronos finetune``: profile, partition the pretrained model, load this rank's
    shard, fine-tune (LoRA with ``cfg.lora_r``), evaluate, and save the merged model; the rank's report."""
    from .partition import even_partition, partition
    from .profile import profile_group
    from .train import TPTrainer, TrainConfig

    cfg = TrainConfig(**cfg_dict)
    ckpt = inspect_checkpoint(model_dir)
    shape = model_shape(ckpt.config, cfg.mlp_block)
    vocab = ckpt.config.vocab_size
    costs, _ = profile_group(shape, cfg.batch, cfg.seq_len, vocab=vocab, memory_bytes=memory_bytes)
    part = partition(shape, costs) if mode == "xronos" else even_partition(shape, world)
    vocab_parallel = split_vocab(ckpt.config, cfg.vocab_parallel)
    model, stats = load_sharded(ckpt, part, rank, None, vocab_parallel)
    trainer = TPTrainer(cfg, part, rank, None, pretrained_corpus(ckpt, cfg), model=model)
    losses = [trainer.step()["loss"] for _ in range(cfg.steps)]
    eval_loss = trainer.evaluate()
    saved = save_merged(model, save_dir, None, rank) if save_dir else None
    return {
        "rank": rank,
        "partition": part.describe(),
        "load": stats.describe() | {"checkpoint_bytes": ckpt.file_bytes()},
        "vocab_parallel": vocab_parallel,
        "tokens": "tokenizer" if has_tokenizer(ckpt) else "bytes",
        "losses": losses,
        "eval_loss": eval_loss,
        "saved": None if saved is None else str(saved),
    }


def check_finetune(model_dir: str | os.PathLike, cfg, world: int) -> Checkpoint:
    """Refuse a ``finetune`` run before any rank starts: the directory, the byte-level data's vocabulary,
    and a model whose heads cannot be split across ``world`` ranks."""
    cfg.validate()
    ckpt = inspect_checkpoint(model_dir)
    if ckpt.config.vocab_size < 256 and not has_tokenizer(ckpt):
        raise PretrainedError(
            f"{ckpt.path}: vocab_size {ckpt.config.vocab_size} is below 256 and there is no tokenizer "
            f"({' or '.join(TOKENIZER_FILES)}), so the text would be trained on as bytes (ids 0-255)"
        )
    shape = model_shape(ckpt.config, cfg.mlp_block)
    if shape.attn_units < world or shape.mlp_units < world:
        raise PretrainedError(
            f"{ckpt.path}: {shape.num_kv_heads} KV heads and {shape.mlp_units} MLP blocks cannot be split across "
            f"{world} ranks"
        )
    return ckpt


def finetune_pretrained(
    model_dir: str | os.PathLike,
    cfg,
    speeds: list[float],
    mode: str = "xronos",
    save_dir: str | os.PathLike | None = None,
    memory_bytes: float | None = None,
    timeout_s: float = 3600.0,
    emulate: str = "dilate",
) -> list[dict]:
    """Fine-tune the pretrained model in ``model_dir`` on ``len(speeds)`` local ranks; each rank's report."""
    from .launch import spawn

    if mode not in ("xronos", "tp"):
        raise ValueError(f"mode must be 'xronos' or 'tp', not {mode!r}")
    check_finetune(model_dir, cfg, len(speeds))
    args = (str(model_dir), cfg.to_dict(), mode, None if save_dir is None else str(save_dir), memory_bytes)
    return spawn(
        finetune_pretrained_rank,
        len(speeds),
        args,
        speeds=speeds,
        timeout_s=timeout_s,
        pg_timeout_s=300,
        emulate=emulate,
    )
