import pytest
import torch
from conftest import tiny_model

from parser_moe import CalibrationError, Reservoir, calibrate


def test_reservoir_keeps_cap_rows_from_the_stream_uniformly():
    counts = torch.zeros(100)
    for seed in range(200):
        r = Reservoir(10, 1, torch.Generator().manual_seed(seed))
        for start in range(0, 100, 7):  # uneven batches
            rows = torch.arange(start, min(start + 7, 100)).float()[:, None]
            r.add(rows, rows[:, 0] * 2)
        x, w = r.tensors()
        assert r.seen == 100 and x.shape == (10, 1)
        assert torch.equal(w, x[:, 0] * 2)  # weights travel with their rows
        assert len(set(x[:, 0].tolist())) == 10
        counts[x[:, 0].long()] += 1
    # each of 100 rows kept with probability 0.1: 20 expected of 200 trials; early and late rows alike
    assert counts[:50].sum() == pytest.approx(1000, rel=0.15)
    assert counts[50:].sum() == pytest.approx(1000, rel=0.15)


def test_calibrate_samples_routed_inputs_and_weights(ids):
    model = tiny_model("qwen2_moe")
    data = calibrate(model, ids, max_per_expert=16)
    assert data.tokens == ids.numel()
    for lc in data.layers.values():
        assert sum(lc.routed) == ids.numel() * 2  # top-2 routing
        for x, w, n in zip(lc.inputs, lc.weights, lc.routed):
            assert x.shape == (min(n, 16), 32) and w.shape == (min(n, 16),)
            assert bool(((w > 0) & (w <= 1)).all())


def test_calibrate_inputs_are_what_the_experts_receive(ids):
    model = tiny_model("mixtral")
    data = calibrate(model, ids[:1], max_per_expert=None, max_bytes=1 << 30)
    seen = []
    ly = model.model.layers[0].mlp.experts
    h = ly.register_forward_pre_hook(lambda m, a: seen.append(a))
    with torch.no_grad():
        model(input_ids=ids[:1])
    h.remove()
    x, idx, w = seen[0]
    tok = (idx == 3).any(-1).nonzero().flatten()
    lc = data.layers["model.layers.0.mlp.experts"]
    torch.testing.assert_close(lc.inputs[3], x[tok])
    torch.testing.assert_close(lc.weights[3], w[idx == 3])


def test_memory_cap_bounds_the_samples(ids):
    model = tiny_model("qwen2_moe")
    cap_bytes = 2 * 4 * 2 * (32 + 1) * 4  # 2 layers x 4 experts x 2 rows
    data = calibrate(model, ids, max_bytes=cap_bytes, max_per_expert=None)
    assert data.nbytes() <= cap_bytes
    assert all(x.shape[0] == 2 for lc in data.layers.values() for x in lc.inputs)
    with pytest.raises(CalibrationError, match="max_bytes"):
        calibrate(model, ids, max_bytes=100)


def test_too_little_text_names_the_missing_expert():
    model = tiny_model("qwen2_moe", experts=8)
    with pytest.raises(
        CalibrationError, match=r"routed no token to expert\(s\) \[.*\] of layer 'model\.layers\.\d\.mlp\.experts'"
    ):
        calibrate(model, torch.tensor([[1]]))
