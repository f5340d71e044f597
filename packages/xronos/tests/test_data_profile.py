import pytest
import torch

from xronos.data import ByteCorpus, load_text, stdlib_corpus
from xronos.partition import ModelShape, partition
from xronos.profile import fit_affine, profile_group


def test_stdlib_corpus_is_real_python_and_batches_are_deterministic():
    text = stdlib_corpus(300_000)
    assert b"def " in text and b"import " in text
    c = ByteCorpus(text, 16, seed=1)
    assert torch.equal(c.batch(3, 2), c.batch(3, 2))
    assert not torch.equal(c.batch(3, 2), c.batch(4, 2))
    assert c.batch(0, 2).max() < 256


def test_load_text_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a readable file"):
        load_text(tmp_path / "missing.txt")
    small = tmp_path / "small.txt"
    small.write_text("x" * 10)
    with pytest.raises(ValueError, match="only 10 bytes"):
        load_text(small)


def test_fit_affine_recovers_line():
    a, b = fit_affine([1, 2, 4, 8], [0.5 + 2 * x for x in [1, 2, 4, 8]])
    assert a == pytest.approx(0.5) and b == pytest.approx(2.0)
    a, b = fit_affine([1, 2], [1.0, 3.0])  # negative intercept -> refit through the origin
    assert a == 0 and b > 0


def test_profile_single_rank_gives_usable_cost_model():
    shape = ModelShape(
        hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, num_layers=2, mlp_block=16
    )
    costs, info = profile_group(shape, batch=1, seq=8, min_time_s=0.002)
    assert len(costs) == 1 and costs[0].attn_per_unit_s > 0 and costs[0].mlp_per_unit_s > 0
    assert info["ranks"][0]["samples"]["mlp"]
    p = partition(shape, costs * 2)  # two identical ranks -> even split
    assert p.attn_units == (1, 1) and p.mlp_units == (2, 2)
