"""Tiny models of real transformers architectures, built locally from configs (never downloaded).

Each entry is a *family* (llama, qwen2, qwen2-moe, gpt2, clip-vit, siglip-vit, vit, llava-clip, llava-siglip,
qwen2-vl)
and a *size* (width/depth).  `build(name)` returns a `ZooModel` that knows how to make a training
batch for a (batch, seq_len, image) shape and how to split itself into stages for tracing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from .names import FAMILIES, HELDOUT_FAMILIES, MODALITY, SIZES, model_names, parse_model_name

__all__ = [
    "FAMILIES",
    "HELDOUT_FAMILIES",
    "MODALITY",
    "Shape",
    "ZooModel",
    "build",
    "components",
    "model_names",
    "parse_model_name",
]

VOCAB = 512
IMAGE_TOKEN = VOCAB - 1
# Qwen2-VL: image placeholder, vision start/end (and an unused video token); text ids stay below
QVL_IMAGE, QVL_VIDEO, QVL_START, QVL_END = VOCAB - 1, VOCAB - 2, VOCAB - 3, VOCAB - 4
QVL_PATCH, QVL_MERGE, QVL_TEMPORAL = 4, 2, 2
NUM_CLASSES = 16


@dataclasses.dataclass(frozen=True)
class Shape:
    """A training batch shape: batch size, text tokens per sample, image side in pixels (0 = none)."""

    batch: int
    seq_len: int = 64
    image_size: int = 32

    def __post_init__(self) -> None:
        for f in ("batch", "seq_len", "image_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0 or (f == "batch" and v < 1):
                raise ValueError(f"shape.{f}: {v!r} is not valid; use a positive integer")


class VisionClassifier(nn.Module):
    """A vision tower (CLIP or SigLIP) with a linear classification head on the pooled output."""

    def __init__(self, tower: nn.Module, hidden: int):
        super().__init__()
        self.vision_model = tower
        self.classifier = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None):
        out = self.vision_model(pixel_values=pixel_values)
        logits = self.classifier(out.pooler_output)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return _Out(loss=loss, logits=logits)


@dataclasses.dataclass
class _Out:
    loss: torch.Tensor | None
    logits: torch.Tensor


def _patch(image_size: int) -> int:
    return 8 if image_size >= 16 else max(1, image_size // 2)


def _decoder_kwargs(size: str, max_pos: int = 2048) -> dict:
    """Llama-style decoder dimensions of a zoo size (grouped-query attention, 2 heads per KV head)."""
    h, i, n, a = SIZES[size]
    return dict(
        vocab_size=VOCAB,
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=n,
        num_attention_heads=a,
        num_key_value_heads=max(1, a // 2),
        max_position_embeddings=max_pos,
    )


def _text_config(family: str, size: str, max_pos: int = 2048):
    import transformers as T

    h, i, n, a = SIZES[size]
    if family in ("llama", "qwen2"):
        cls = T.LlamaConfig if family == "llama" else T.Qwen2Config
        return cls(**_decoder_kwargs(size, max_pos))
    if family == "qwen2-moe":  # 4 routed experts (top-2, fused gate_up_proj/down_proj) + a shared expert
        return T.Qwen2MoeConfig(
            **_decoder_kwargs(size, max_pos),
            moe_intermediate_size=i // 2,
            shared_expert_intermediate_size=i // 2,
            num_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        )
    if family == "gpt2":
        return T.GPT2Config(
            vocab_size=VOCAB,
            n_embd=h,
            n_layer=n,
            n_head=a,
            n_positions=max_pos,
            n_inner=i,
            bos_token_id=0,
            eos_token_id=0,
        )
    raise ValueError(family)


def _vision_config(kind: str, size: str, image_size: int):
    import transformers as T

    h, i, n, a = SIZES[size]
    kw: dict[str, Any] = dict(
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=n,
        num_attention_heads=a,
        image_size=image_size,
        patch_size=_patch(image_size),
    )
    if kind == "clip":
        return T.CLIPVisionConfig(**kw)
    if kind == "siglip":
        return T.SiglipVisionConfig(**kw)
    if kind == "vit":
        # a config takes keyword arguments its dataclass typing does not show (num_labels)
        return T.ViTConfig(**kw, num_labels=NUM_CLASSES)  # type: ignore[call-arg]
    raise ValueError(kind)


def _qwen2_vl_config(size: str, image_size: int):
    """Qwen2-VL: a ViT over variable-resolution patches with 2-D rotary positions, a 2x2 patch merger
    into the language model's width, and a Qwen2 language model with 3-D (M-RoPE) positions."""
    import transformers as T

    if image_size % (QVL_PATCH * QVL_MERGE):
        raise ValueError(f"image_size: {image_size} must be a multiple of {QVL_PATCH * QVL_MERGE} for qwen2-vl")
    h, i, n, a = SIZES[size]
    half = h // a // 2  # M-RoPE splits half the head dimension into temporal, height, width sections
    sec = 3 * half // 8
    vision = dict(
        depth=n,
        embed_dim=h,
        hidden_size=h,
        num_heads=a,
        mlp_ratio=2,
        patch_size=QVL_PATCH,
        spatial_merge_size=QVL_MERGE,
        temporal_patch_size=QVL_TEMPORAL,
        in_channels=3,
    )
    text = dict(
        **_decoder_kwargs(size),
        bos_token_id=0,
        eos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * sec, sec, sec]},
    )
    return T.Qwen2VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=QVL_IMAGE,
        video_token_id=QVL_VIDEO,
        vision_start_token_id=QVL_START,
        vision_end_token_id=QVL_END,
        # keyword arguments the config takes but its dataclass typing does not show
        bos_token_id=0,  # type: ignore[call-arg]
        eos_token_id=0,
    )


@dataclasses.dataclass
class ZooModel:
    """A built model plus what tracing and training need to know about it."""

    name: str
    family: str
    size: str
    modality: str
    module: nn.Module
    image_size: int
    vocab: int = VOCAB
    num_classes: int = NUM_CLASSES
    patch: int = 0
    """Vision patch side in pixels (0: the zoo's own, `_patch(image_size)`)."""
    image_token: int = IMAGE_TOKEN

    def image_tokens(self) -> int:
        if self.modality == "text":
            return 0
        if self.family == "qwen2-vl":  # patches merged 2x2 into one language token
            return (self.image_size // QVL_PATCH) ** 2 // QVL_MERGE**2
        p = self.patch or _patch(self.image_size)
        return (self.image_size // p) ** 2

    def num_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def make_batch(self, shape: Shape, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
        """Random inputs and labels of `shape` (pixel values in `dtype`)."""
        g = torch.Generator().manual_seed(seed)
        if self.modality == "vision":
            px = torch.randn(shape.batch, 3, self.image_size, self.image_size, generator=g).to(dtype)
            labels = torch.randint(0, self.num_classes, (shape.batch,), generator=g)
            return {"pixel_values": px, "labels": labels}
        # text ids stay below the zoo's reserved ids, and below the model's own vocabulary
        ids = torch.randint(0, min(self.vocab, VOCAB) - 1, (shape.batch, shape.seq_len), generator=g)
        if self.modality == "text":
            return {"input_ids": ids, "labels": ids.clone()}
        if self.family == "qwen2-vl":
            return self._qwen2_vl_batch(shape, dtype, g)
        n_img = self.image_tokens()
        ids = torch.cat([torch.full((shape.batch, n_img), self.image_token), ids], dim=1)
        labels = ids.clone()
        labels[:, :n_img] = -100
        px = torch.randn(shape.batch, 3, self.image_size, self.image_size, generator=g).to(dtype)
        return {"input_ids": ids, "pixel_values": px, "labels": labels}

    def _qwen2_vl_batch(self, shape: Shape, dtype: torch.dtype, g: torch.Generator) -> dict:
        """One image per sample as Qwen2-VL's processor lays it out: flattened patches
        [B * h * w, C * temporal * patch^2] with their (t, h, w) grid, and <start> image-tokens <end>
        text in the ids, with the multimodal token types the 3-D RoPE positions need."""
        b, side = shape.batch, self.image_size // QVL_PATCH
        px = torch.randn(b * side * side, 3 * QVL_TEMPORAL * QVL_PATCH**2, generator=g).to(dtype)
        grid = torch.tensor([[1, side, side]] * b)
        n_img = self.image_tokens()
        text = torch.randint(0, QVL_END, (b, shape.seq_len), generator=g)
        ids = torch.cat(
            [torch.full((b, 1), QVL_START), torch.full((b, n_img), QVL_IMAGE), torch.full((b, 1), QVL_END), text], 1
        )
        labels = ids.clone()
        labels[:, : n_img + 2] = -100
        types = (ids == QVL_IMAGE).long()
        return {
            "input_ids": ids,
            "pixel_values": px,
            "image_grid_thw": grid,
            "mm_token_type_ids": types,
            "labels": labels,
        }

    def total_tokens(self, shape: Shape) -> int:
        """Tokens the (language or vision) transformer processes per sample."""
        if self.modality == "text":
            return shape.seq_len
        if self.modality == "vision":
            return self.image_tokens()
        return shape.seq_len + self.image_tokens() + (2 if self.family == "qwen2-vl" else 0)

    def stages(self, batch: dict) -> list[tuple[str, Callable[[], object]]]:
        """The forward pass as traceable stages (multimodal models are split into vision, projector
        and language stages so no stage needs data-dependent ops such as token merging)."""
        m = self.module
        if self.modality != "multimodal" or self.family == "qwen2-vl":
            # Qwen2-VL's merge (placeholder mask) and 3-D positions read the real token ids
            return [("model", lambda: m(**batch))]
        return _llava_stages(m, batch, self.image_tokens())


def _llava_stages(m: nn.Module, batch: dict, n_img: int) -> list[tuple[str, Callable[[], object]]]:
    inner = m.model
    cfg = m.config
    state: dict = {"n_img": n_img}

    def vision():
        out = inner.vision_tower(batch["pixel_values"], output_hidden_states=True)
        feats = out.hidden_states[cfg.vision_feature_layer]
        if cfg.vision_feature_select_strategy == "default" and feats.shape[1] > state["n_img"]:
            feats = feats[:, 1:]
        state["feats"] = feats
        return out

    def projector():
        state["img"] = inner.multi_modal_projector(state["feats"])
        return state["img"]

    def language():
        ids = batch["input_ids"]
        emb = inner.get_input_embeddings()(ids)
        n = state["n_img"]
        emb = torch.cat([state["img"].to(emb.dtype), emb[:, n:]], dim=1)
        hs = inner.language_model(inputs_embeds=emb).last_hidden_state
        logits = m.lm_head(hs)
        loss = m.loss_function(logits=logits, labels=batch["labels"], vocab_size=cfg.text_config.vocab_size)
        return _Out(loss=loss, logits=logits)

    return [("vision", vision), ("projector", projector), ("language", language)]


def _heldout_module(family: str, size: str, image_size: int) -> nn.Module:
    """A held-out architecture (`HELDOUT_FAMILIES`): GPT-NeoX, OPT, DINOv2, or a LLaVA-shaped
    DINOv2 vision tower + Phi decoder, at a zoo size."""
    import transformers as T

    h, i, n, a = SIZES[size]
    text: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=h, num_hidden_layers=n, num_attention_heads=a)
    if family == "gpt-neox":
        neox = T.GPTNeoXConfig(**text, intermediate_size=i, max_position_embeddings=2048)
        neox._attn_implementation = "sdpa"
        return T.GPTNeoXForCausalLM(neox)
    if family == "opt":
        opt = T.OPTConfig(**text, ffn_dim=i, word_embed_proj_dim=h, max_position_embeddings=2048)
        opt._attn_implementation = "sdpa"
        return T.OPTForCausalLM(opt)
    vision = T.Dinov2Config(
        hidden_size=h if family == "dinov2" else SIZES["xs" if size in ("xs", "s") else "s"][0],
        num_hidden_layers=n if family == "dinov2" else 2,
        num_attention_heads=a if family == "dinov2" else 2,
        mlp_ratio=i // h,
        image_size=image_size,
        patch_size=_patch(image_size),
        # a config takes keyword arguments its dataclass typing does not show (num_labels)
        num_labels=NUM_CLASSES,  # type: ignore[call-arg]
    )
    if family == "dinov2":
        return T.Dinov2ForImageClassification(vision)
    phi = T.PhiConfig(**text, intermediate_size=i, max_position_embeddings=2048)
    return _llava(vision, phi, "default")


def _llava(vision, text, strategy: Literal["default", "full"]) -> nn.Module:
    """A LLaVA-shaped model: vision tower, two-layer GELU projector, decoder; image tokens first."""
    import transformers as T

    cfg = T.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy=strategy,
    )
    return T.LlavaForConditionalGeneration(cfg)


def components(module: nn.Module) -> set[str]:
    """The architecture components of a model: every module class transformers defines for one
    model family (decoder layers, attention, vision embeddings, projectors, wrappers), by qualified
    name.  Generic modules (nn.Linear, activations) are shared by every architecture and not
    components."""
    return {
        f"{type(m).__module__}.{type(m).__qualname__}"
        for m in module.modules()
        if type(m).__module__.startswith("transformers.models.")
    }


def build(name: str, image_size: int = 32, seed: int = 0) -> ZooModel:
    """Build the tiny model `name` (e.g. 'llama-s', 'llava-clip-xs', or a held-out architecture such
    as 'gpt-neox-xl') with random weights."""
    import transformers as T

    family, size = parse_model_name(name)
    torch.manual_seed(seed)
    modality = MODALITY[family]
    if family in HELDOUT_FAMILIES:
        module = _heldout_module(family, size, image_size)
    elif modality == "text":
        cfg = _text_config(family, size)
        cfg._attn_implementation = "sdpa"
        cls = {
            "llama": T.LlamaForCausalLM,
            "qwen2": T.Qwen2ForCausalLM,
            "qwen2-moe": T.Qwen2MoeForCausalLM,
            "gpt2": T.GPT2LMHeadModel,
        }[family]
        module = cls(cfg)
    elif family == "qwen2-vl":
        module = T.Qwen2VLForConditionalGeneration(_qwen2_vl_config(size, image_size))
    elif family == "vit":
        module = T.ViTForImageClassification(_vision_config("vit", size, image_size))
    elif modality == "vision":
        kind = family.split("-")[0]
        vc = _vision_config(kind, size, image_size)
        tower = T.CLIPVisionModel(vc) if kind == "clip" else T.SiglipVisionModel(vc)
        module = VisionClassifier(tower, vc.hidden_size)
    else:
        kind = family.split("-")[1]
        vc = _vision_config(kind, "xs" if size in ("xs", "s") else "s", image_size)
        tc = _text_config("llama" if kind == "clip" else "qwen2", size)
        module = _llava(vc, tc, "default" if kind == "clip" else "full")
    module.train()
    return ZooModel(name, family, size, modality, module, image_size)
