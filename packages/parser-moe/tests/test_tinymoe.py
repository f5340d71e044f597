import torch

from parser_moe import find_moe_layers
from parser_moe.data import sequences, split_text
from parser_moe.tinymoe import TinyMoEConfig, build_model, load_or_train

MICRO = TinyMoEConfig(
    hidden=16, layers=2, heads=2, experts=4, expert_intermediate=8, shared_intermediate=8, seq_len=16, batch=2, steps=3
)


def test_splits_do_not_overlap_and_are_real_text():
    ev, cal = split_text("eval", 4000), split_text("calib", 4000)
    assert b"def " in ev and b"import" in cal
    assert ev[:200] not in split_text("train")
    assert sequences("eval", 3, 50).shape == (3, 50)


def test_experts_start_upcycled():
    model = build_model(MICRO)
    w = find_moe_layers(model)[0].weights()
    spread = (w.gate - w.gate.mean(0)).norm() / w.gate.norm()
    assert 0 < float(spread) < 0.05


def test_load_or_train_caches_atomically(tmp_path):
    m1, info1 = load_or_train(MICRO, cache_dir=tmp_path, progress=False)
    assert info1["cached"] is False and info1["steps"] == 3
    entries = [p.name for p in tmp_path.iterdir()]
    assert entries == [MICRO.key()]  # no temp dirs left behind
    m2, info2 = load_or_train(MICRO, cache_dir=tmp_path, progress=False)
    assert info2["cached"] is True
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(m1(input_ids=ids).logits, m2(input_ids=ids).logits)
