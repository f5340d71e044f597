import pytest
import torch
from conftest import tiny_model
from test_models import PerExpertModel

from parser_moe import (
    METHODS,
    CompressedExperts,
    calibrate,
    compress_model,
    compressed_modules,
    find_moe_layers,
    load_compressed,
    module_bytes,
    prepare,
    save_compressed,
)
from parser_moe.pipeline import entry_ratio_for


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("base", ["mean", "aligned"])
def test_keep_ratio_one_reproduces_the_original_outputs(family, base, ids):
    model = tiny_model(family)
    plan = prepare(model, calibrate(model, ids), base)
    for structured in (True, False):
        cm = compress_model(model, plan, "parser", 1.0, structured=structured)
        assert len(compressed_modules(cm)) == 2
        torch.testing.assert_close(_logits(cm, ids), _logits(model, ids), rtol=1e-4, atol=1e-4)


def test_forward_is_exact_for_what_is_kept(ids):
    """The fast forward (base once + corrections) equals dense experts rebuilt from base + kept residuals."""
    model = tiny_model("qwen2_moe")
    plan = prepare(model, calibrate(model, ids), "aligned")
    cm = compress_model(model, plan, "parser", 0.3)
    mod = cm.model.layers[0].mlp.experts
    g, u, d = mod.expert_weights()
    x = torch.randn(9, 32)
    idx = torch.randint(0, 4, (9, 2))
    w = torch.rand(9, 2)
    ref = torch.zeros(9, 32)
    for t in range(9):
        for s in range(2):
            e = int(idx[t, s])
            ref[t] += w[t, s] * (mod.act_fn(x[t] @ g[e].T) * (x[t] @ u[e].T)) @ d[e].T
    torch.testing.assert_close(mod(x, idx, w), ref, rtol=1e-5, atol=1e-5)
    # kept units carry the full expert weights, the others the base
    dec = plan.decomps["model.layers.0.mlp.experts"]
    k = mod.kept_index[: int(mod.kept_offsets[1])].long()
    torch.testing.assert_close(g[0, k], dec.experts.gate[0, k])
    drop = torch.ones(dec.experts.intermediate, dtype=torch.bool)
    drop[k] = False
    torch.testing.assert_close(g[0, drop], dec.base_gate[drop])


def test_memory_is_the_sum_of_tensor_bytes_and_equal_across_methods(ids):
    model = tiny_model("qwen2_moe")
    plan = prepare(model, calibrate(model, ids), "aligned")
    E, inter, H = 4, 16, 32
    assert plan.original_bytes() == 2 * E * 3 * inter * H * 4
    sizes = set()
    for method in METHODS:
        cm = compress_model(model, plan, method, 0.25)
        total = 0
        for mod in compressed_modules(cm).values():
            by_hand = sum(t.numel() * t.element_size() for t in mod.state_dict().values())
            assert mod.nbytes() == by_hand == module_bytes(mod)
            k = int(mod.kept_index.numel())
            assert k == round(0.25 * E * inter)
            # base (3 I H floats) + kept residual rows (3 H floats + int32 index each) + offsets
            assert by_hand == 3 * inter * H * 4 + k * (3 * H * 4 + 4) + (E + 1) * 8
            total += by_hand
        sizes.add(total)
    assert len(sizes) == 1  # same memory for every method


def test_unstructured_budget_matches_structured_bytes(ids):
    model = tiny_model("qwen2_moe")
    plan = prepare(model, calibrate(model, ids), "mean")
    s = compress_model(model, plan, "parser", 0.2)
    u = compress_model(model, plan, "parser", entry_ratio_for(0.2, 32, 4), structured=False)
    bs = sum(m.nbytes() for m in compressed_modules(s).values())
    bu = sum(m.nbytes() for m in compressed_modules(u).values())
    assert abs(bs - bu) / bs < 0.02


def test_save_load_round_trip_gives_identical_outputs(tmp_path, ids):
    model = tiny_model("qwen2_moe")
    plan = prepare(model, calibrate(model, ids), "aligned")
    for structured in (True, False):
        cm = compress_model(model, plan, "wanda", 0.2, structured=structured)
        out = save_compressed(cm, tmp_path / f"c{structured}")
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
        loaded = load_compressed(out)
        assert all(isinstance(m, CompressedExperts) for m in compressed_modules(loaded).values())
        assert torch.equal(_logits(loaded, ids), _logits(cm, ids))
    with pytest.raises(FileNotFoundError, match="missing"):
        load_compressed(tmp_path)


def test_per_expert_layout_compresses_with_one_shared_base():
    torch.manual_seed(0)
    model = PerExpertModel().eval()
    ids = torch.randint(0, 64, (64,))
    plan = prepare(model, calibrate(model, ids[None]), "aligned")
    ref = model(input_ids=ids)
    full = compress_model(model, plan, "parser", 1.0)
    torch.testing.assert_close(full(input_ids=ids), ref, rtol=1e-5, atol=1e-5)
    small = compress_model(model, plan, "parser", 0.25)
    lst = small.blocks[0].experts
    assert len(lst) == 4 and lst.nbytes() == module_bytes(lst.storage)
    assert lst.nbytes() < find_moe_layers(model)[0].original_bytes()
    assert not torch.equal(small(input_ids=ids), ref)


def test_bad_method_and_ratio_are_rejected(ids):
    model = tiny_model("qwen2_moe")
    plan = prepare(model, calibrate(model, ids), "mean")
    with pytest.raises(ValueError, match="method must be one of"):
        compress_model(model, plan, "random", 0.2)
    with pytest.raises(ValueError, match="keep_ratio must be in"):
        compress_model(model, plan, "parser", 0.0)


def test_base_only_model_runs_every_expert_as_the_base(ids):
    from parser_moe.pipeline import base_only_model

    model = tiny_model("qwen2_moe")
    plan = prepare(model, calibrate(model, ids), "mean")
    bo = base_only_model(model, plan)
    mod = bo.model.layers[1].mlp.experts
    assert mod.kept_index.numel() == 0
    g, _, d = mod.expert_weights()
    torch.testing.assert_close(g[2], plan.decomps["model.layers.1.mlp.experts"].base_gate)
    assert not torch.allclose(_logits(bo, ids), _logits(model, ids))
    full = compress_model(model, plan, "reference", 1.0)
    torch.testing.assert_close(_logits(full, ids), _logits(model, ids), rtol=1e-4, atol=1e-4)
