"""Compress then predict: sysprdict predicts the training memory of a parser-moe-compressed MoE.

A user compresses a tiny Qwen2-MoE with parser-moe (shared base + kept residuals), then asks
sysprdict how much memory fine-tuning the compressed model needs, and checks the answer against a
measurement (sysprdict's own MemTracker path) within sysprdict's usual error (5%, its test bound).
"""

import torch
from transformers import AutoModelForCausalLM, Qwen2MoeConfig

import parser_moe
import sysprdict
from sysprdict.train import measure_training

USUAL_ERROR = 0.05  # sysprdict's own bound against MemTracker (tests/test_memory.py)


def tiny_moe() -> torch.nn.Module:
    cfg = Qwen2MoeConfig(
        vocab_size=512,  # sysprdict's text batches draw ids below 512
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def test_sysprdict_predicts_memory_of_compressed_moe():
    model = tiny_moe()
    calib = parser_moe.calibrate(model, torch.randint(0, 511, (8, 32)), max_bytes=4 << 20)
    plan = parser_moe.prepare(model, calib, base="mean")
    small = parser_moe.compress_model(model, plan, "parser", keep_ratio=0.2)
    experts = parser_moe.compressed_modules(small)
    assert experts and sum(m.nbytes() for m in experts.values()) < plan.original_bytes()

    # the compressed model, described to sysprdict as a text model of its zoo's shape
    zm = sysprdict.ZooModel("qwen2moe-parser", "qwen2", "xs", "text", small, 0)
    shape = sysprdict.Shape(2, 24)
    measured = measure_training(zm, shape, "fp32", "adamw", steps=1, warmup=1)
    assert measured.peak_bytes > 0
    # the compressed experts live in buffers: part of what a prediction has to account for
    assert measured.breakdown.get("Buffer", 0) >= sum(m.nbytes() for m in experts.values())

    d = sysprdict.decompose(zm, shape, "fp32")
    pred = sysprdict.predict_memory(d, sysprdict.TrainSetup("adamw"))
    err = abs(pred.peak_bytes / measured.peak_bytes - 1)
    assert err < USUAL_ERROR, (pred.peak_bytes, measured.peak_bytes, pred.peak_event, measured.breakdown)
