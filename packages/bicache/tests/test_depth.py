import pytest
import torch

from bicache import depth, diffusion, kvcache


@pytest.fixture(scope="module")
def cal(dlm):
    return depth.calibrate(dlm, shared_rows=[0, 3, 7], requests_per_fraction=3, groups=1)


def test_calibration_measures_drift(dlm, cal):
    assert cal.fractions == sorted(cal.fractions)
    n = dlm.num_layers
    for kv, hid, exposed in zip(cal.kv, cal.hidden, cal.drift):
        assert len(kv) == n and len(hid) == n + 1 and len(exposed) == n
        assert kv[0] == 0.0 and hid[0] == 0.0  # token-only quantities: exactly reusable
        assert all(x > 0 for x in kv[1:])  # measured, not assumed invariant
        assert hid[1] > 0
        # exposure of depth L includes the stale hidden state entering layer L
        assert exposed[0] == pytest.approx(hid[1])
        assert exposed == sorted(exposed) or max(exposed) > 0
    # a larger shared fraction drifts less at the first contextual layer
    assert cal.kv[-1][1] < cal.kv[0][1]


def test_drift_matches_direct_measurement(dlm, task):
    reqs = task.burst(3, 3)
    x = torch.tensor([r.prompt + [dlm.mask_id] * 4 for r in reqs])
    p = reqs[0].prefix_len
    entry, _ = kvcache.fill_entry(dlm, x[:1], p)
    keys, _ = kvcache.layer_kv(dlm, x[1:])
    d = depth.kv_drift(entry.keys[2], keys[2][:, :, :p])
    manual = [((keys[2][i, :, :p] - entry.keys[2][0]).norm() / keys[2][i, :, :p].norm()).item() for i in range(2)]
    assert d.tolist() == pytest.approx(manual, rel=1e-5)


def test_policy_depth_and_explain():
    cal = depth.Calibration(
        fractions=[0.25, 0.5, 0.9],
        kv=[[0, 0.1, 0.3, 0.5]] * 3,
        hidden=[[0, 0.1, 0.3, 0.5, 0.6]] * 3,
        drift=[[0.05, 0.2, 0.4, 0.6], [0.02, 0.06, 0.3, 0.5], [0.01, 0.02, 0.04, 0.2]],
        drift_max=[[0.1, 0.3, 0.5, 0.7]] * 3,
        samples=1,
        num_layers=4,
    )
    pol = depth.DepthPolicy(cal, bound=0.05)
    assert pol.depth(0.25) == 1
    assert pol.depth(0.5) == 1
    assert pol.depth(0.6) == 1  # conservative: reads the 0.5 row
    assert pol.depth(0.95) == 3
    assert pol.depth(0.1) == 0  # below every calibrated fraction: nothing reused
    ex = pol.explain(0.95)
    assert ex["depth"] == 3 and ex["calibrated_fraction"] == 0.9 and "layer" in ex["reason"]
    assert depth.DepthPolicy(cal, bound=1.0).explain(0.9)["reason"].startswith("drift at every depth")
    with pytest.raises(ValueError, match="fraction"):
        pol.depth(1.5)
    assert depth.Calibration.from_dict(cal.to_dict()) == cal


def test_choose_bound_keeps_answers(dlm, cal):
    cfg = diffusion.DecodeConfig(4, 2, 4)
    bound, report = depth.choose_bound(dlm, cal, max_disagreement=0.0, requests_per_fraction=3, cfg=cfg)
    assert report  # candidates were tried
    pol = depth.DepthPolicy(cal, bound)
    # the chosen policy reproduces the no-cache answers on the calibration requests
    last = report[f"{bound:.5g}"] if bound else list(report.values())[-1]
    if bound:
        assert last["disagreement"] == 0.0
    assert all(0 <= pol.depth(f) <= dlm.num_layers for f in cal.fractions)
