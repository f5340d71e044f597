"""Compressed models through transformers' own save_pretrained / from_pretrained."""

import json

import pytest
import torch
from conftest import tiny_config, tiny_model
from test_compressed import _logits

from parser_moe import (
    CompressedExperts,
    ParserMoeConfig,
    ParserMoeForCausalLM,
    calibrate,
    compress_model,
    compressed_modules,
    load_compressed,
    prepare,
    save_compressed,
)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("structured", [True, False])
def test_save_pretrained_and_auto_from_pretrained_round_trip_exactly(family, structured, tmp_path, ids):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = tiny_model(family)
    plan = prepare(model, calibrate(model, ids), "aligned")
    cm = compress_model(model, plan, "parser", 0.25, structured=structured)
    ParserMoeForCausalLM.wrap(cm).save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "parser_moe"
    assert isinstance(AutoConfig.from_pretrained(str(tmp_path)), ParserMoeConfig)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert isinstance(loaded, ParserMoeForCausalLM)
    assert torch.equal(_logits(loaded, ids), _logits(cm, ids))
    mods = compressed_modules(loaded.inner)
    assert set(mods) == set(compressed_modules(cm))
    for name, mod in mods.items():
        src = compressed_modules(cm)[name]
        assert mod.mode == ("units" if structured else "entries")
        for key, t in src.state_dict().items():
            assert torch.equal(mod.state_dict()[key], t), key


def test_save_compressed_writes_the_transformers_format_and_load_compressed_reads_it(tmp_path, ids):
    model = tiny_model("qwen2_moe")
    plan = prepare(model, calibrate(model, ids), "mean")
    cm = compress_model(model, plan, "parser", 0.25)
    out = save_compressed(cm, tmp_path / "c")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    again = load_compressed(out)
    assert all(isinstance(m, CompressedExperts) for m in compressed_modules(again).values())
    assert torch.equal(_logits(again, ids), _logits(cm, ids))


def test_tied_embeddings_stay_tied(tmp_path, ids):
    import transformers as T

    cfg = tiny_config("qwen3_moe")
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    plan = prepare(model, calibrate(model, ids, require_all_experts=False), "mean")
    cm = compress_model(model, plan, "parser", 0.25)
    save_compressed(cm, tmp_path)
    loaded = T.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert loaded.inner.lm_head.weight is loaded.inner.model.embed_tokens.weight
    assert torch.equal(_logits(loaded, ids), _logits(cm, ids))


def test_first_format_directories_still_load(tmp_path, ids):
    from safetensors.torch import save_model

    from parser_moe.compressed import FORMAT_VERSION, compressed_layers

    model = tiny_model("qwen2_moe")
    cm = compress_model(model, prepare(model, calibrate(model, ids), "mean"), "wanda", 0.25)
    cm.config.to_json_file(str(tmp_path / "config.json"))
    meta = {"format": FORMAT_VERSION, "layers": compressed_layers(cm)}
    (tmp_path / "parser_moe.json").write_text(json.dumps(meta))
    save_model(cm, str(tmp_path / "model.safetensors"))
    assert torch.equal(_logits(load_compressed(tmp_path), ids), _logits(cm, ids))


def test_wrapping_an_uncompressed_model_is_refused(ids):
    with pytest.raises(ValueError, match="no compressed experts"):
        ParserMoeForCausalLM.wrap(tiny_model("qwen2_moe"))
