"""Geo training then compression: a tiny MoE trained with geomesh's DiLoCo is compressed by parser-moe.

Two gloo ranks train a tiny upcycled Qwen2-MoE on Python stdlib sources (bytes) with geomesh's
sign-compressed DiLoCo outer loop for a few steps; rank 0 returns the trained weights. parser-moe
calibrates on held-out text, keeps 30% of the residual units, and the perplexity of the initial, the
trained and the compressed model on evaluation text is reported and checked for sanity.
"""

import math
import os

import torch
from transformers import AutoModelForCausalLM, Qwen2MoeConfig

import geomesh
import parser_moe

SEQ, BATCH, INNER, OUTER = 64, 4, 4, 3


def moe_config() -> Qwen2MoeConfig:
    return Qwen2MoeConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, moe_intermediate_size=64, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip


def build_moe() -> torch.nn.Module:
    """Random init with upcycled experts (all start from expert 0 plus noise), as MoEs often are."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config())
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.endswith("mlp.experts"):
                for p in (mod.gate_up_proj, mod.down_proj):
                    p.copy_(p[0:1].expand_as(p) + 0.05 * p[0].std() * torch.randn_like(p))
    return model


def stdlib_bytes(which: str, n: int) -> torch.Tensor:
    """Token ids (bytes) of stdlib sources: every 4th file is held out for calibration/evaluation."""
    files = sorted(
        (p for p in os.scandir(os.path.dirname(os.__file__)) if p.name.endswith(".py")), key=lambda p: p.name
    )
    keep = [f for i, f in enumerate(files) if (i % 4 == 0) == (which != "train")]
    data = bytearray()
    for f in keep:
        data += open(f.path, "rb").read()
        if len(data) >= n:
            break
    return torch.frombuffer(bytearray(data[:n]), dtype=torch.uint8).long()


def perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return math.exp(float(model(input_ids=ids, labels=ids).loss))


def train_rank(rank: int, world: int) -> dict:
    model = build_moe()
    text = stdlib_bytes("train", 200_000)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    outer = geomesh.DiLoCo(model, inner, inner_steps=INNER, compression="sign", outer_lr=0.7)
    model.train()
    for _ in range(INNER * OUTER):
        starts = torch.randint(0, text.numel() - SEQ, (BATCH,), generator=g).tolist()
        x = torch.stack([text[s : s + SEQ] for s in starts])
        model(input_ids=x, labels=x).loss.backward()
        inner.step()
        inner.zero_grad(set_to_none=True)
        outer.step(tokens=x.numel())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()} if rank == 0 else None
    return {
        "state": state,
        "outer_steps": outer.outer_step,
        "payload_bytes": sum(s.payload_bytes for s in outer.history),
    }


def test_diloco_trained_moe_then_parser_compression():
    results = geomesh.spawn(train_rank, 2, backend="gloo", timeout_s=240, pg_timeout_s=60, start_method="spawn")
    assert [r["outer_steps"] for r in results] == [OUTER, OUTER]
    assert results[0]["payload_bytes"] > 0

    held_out = stdlib_bytes("eval", 16 * SEQ + 4096)
    calib, evaluation = held_out[: 8 * SEQ].view(8, SEQ), held_out[4096 : 4096 + 8 * SEQ].view(8, SEQ)
    initial = build_moe()
    trained = build_moe()
    trained.load_state_dict(results[0]["state"])
    ppl_initial, ppl_trained = perplexity(initial, evaluation), perplexity(trained, evaluation)

    plan = parser_moe.prepare(trained, parser_moe.calibrate(trained, calib, max_bytes=4 << 20), base="mean")
    compressed = parser_moe.compress_model(trained, plan, "parser", keep_ratio=0.3)
    ppl_compressed = perplexity(compressed, evaluation)
    expert_bytes = sum(m.nbytes() for m in parser_moe.compressed_modules(compressed).values())
    print(
        f"perplexity: initial {ppl_initial:.2f}, geomesh-trained {ppl_trained:.2f}, parser-compressed (keep 0.3) "
        f"{ppl_compressed:.2f}; experts {plan.original_bytes()} -> {expert_bytes} bytes"
    )
    assert all(math.isfinite(p) for p in (ppl_initial, ppl_trained, ppl_compressed))
    assert ppl_trained < ppl_initial  # DiLoCo training made progress on held-out text
    assert ppl_compressed < 1.25 * ppl_trained  # compression keeps most of what training learned
    assert expert_bytes < plan.original_bytes()
