"""A tiny Qwen2-MoE trained briefly on CPU on the standard library's sources, cached on disk.

Experts are upcycled (all start from one MLP plus small noise, as Qwen1.5-MoE was upcycled from a
dense model), so after training the experts share a common part and differ by what they learned,
which is the structure residual compression relies on. A random-init MoE would make every
comparison meaningless. The trained checkpoint is cached under the user cache dir, keyed by config.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import hwtopo
from hwtopo import console

from .data import VOCAB_SIZE, encode, split_text

if TYPE_CHECKING:  # transformers is imported where a model is built, not with the package
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyMoEConfig:
    hidden: int = 96
    layers: int = 4
    heads: int = 4
    experts: int = 8
    top_k: int = 2
    expert_intermediate: int = 96
    shared_intermediate: int = 48
    seq_len: int = 128
    batch: int = 8
    steps: int = 500
    lr: float = 3e-3
    upcycle_noise: float = 0.02
    aux_loss_coef: float = 0.1
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return "tinymoe-" + hashlib.sha256(blob).hexdigest()[:12]


def hf_config(cfg: TinyMoEConfig):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        intermediate_size=cfg.expert_intermediate,
        moe_intermediate_size=cfg.expert_intermediate,
        shared_expert_intermediate_size=cfg.shared_intermediate,
        num_experts=cfg.experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=False,
        max_position_embeddings=max(256, cfg.seq_len),
        router_aux_loss_coef=cfg.aux_loss_coef,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_model(cfg: TinyMoEConfig) -> PreTrainedModel:
    """A freshly initialised tiny Qwen2-MoE with upcycled experts."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_config(cfg))
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.endswith("mlp.experts"):
                for p in (mod.gate_up_proj, mod.down_proj):
                    p.copy_(p[0:1].expand_as(p) + cfg.upcycle_noise * p[0].std() * torch.randn_like(p))
    return model


def train(cfg: TinyMoEConfig, progress: bool = True) -> tuple[PreTrainedModel, dict]:
    """Train the tiny MoE for ``cfg.steps`` steps on random windows of the training split."""
    model = build_model(cfg)
    ids = encode(split_text("train"))
    g = torch.Generator().manual_seed(cfg.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warm = max(1, cfg.steps // 20)

    def lr_at(step: int) -> float:
        if step < warm:
            return cfg.lr * (step + 1) / warm
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, cfg.steps - warm)))

    losses = []
    bar = console.progress(total=cfg.steps, desc="training tiny MoE", quiet=not progress)
    model.train()
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        starts = torch.randint(0, ids.numel() - cfg.seq_len - 1, (cfg.batch,), generator=g).tolist()
        batch = torch.stack([ids[s : s + cfg.seq_len] for s in starts])
        out = model(input_ids=batch, labels=batch, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    model.eval()
    info = {
        "steps": cfg.steps,
        "train_seconds": time.perf_counter() - t0,
        "final_loss": sum(losses[-20:]) / min(20, len(losses)),
    }
    return model, info


def load_or_train(
    cfg: TinyMoEConfig | None = None, cache_dir: str | Path | None = None, progress: bool = True
) -> tuple[PreTrainedModel, dict]:
    """The trained tiny MoE from the cache, training (and caching, atomically) it when absent.

    Returns (model, info); ``info["cached"]`` says whether it came from the cache.
    """
    from transformers import AutoModelForCausalLM

    cfg = cfg or TinyMoEConfig()
    path = Path(cache_dir or console.cache_dir("parser-moe")) / cfg.key()
    if (path / "model.safetensors").is_file() and (path / "train.json").is_file():
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(str(path))
        model.eval()
        info = json.loads((path / "train.json").read_text())
        info.update(cached=True, path=str(path))
        return model, info
    log.info("training the tiny MoE (%d steps), cache %s", cfg.steps, path)
    model, info = train(cfg, progress=progress)
    info["config"] = asdict(cfg)

    def fill(d: Path) -> None:
        model.save_pretrained(str(d))
        (d / "train.json").write_text(json.dumps(info, indent=2) + "\n")

    hwtopo.atomic_dir(path, fill)
    info.update(cached=False, path=str(path))
    return model, info
