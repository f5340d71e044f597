import pytest
import torch

from parser_moe import check_keep_ratio, select_elements, select_units, unit_output_importance

act = torch.nn.functional.silu


def _expert(inter=6, H=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(inter, H, generator=g), torch.randn(inter, H, generator=g), torch.randn(H, inter, generator=g))
    base = tuple(t + 0.7 * torch.randn(t.shape, generator=g) for t in full)
    x = torch.randn(40, H, generator=g)
    r = torch.rand(40, generator=g)
    return full, base, x, r


def _forward(w, x):
    g, u, d = w
    return (act(x @ g.T) * (x @ u.T)) @ d.T


@pytest.mark.parametrize("weighted", [True, False])
def test_importance_equals_brute_force_output_error(weighted):
    full, base, x, r = _expert()
    r = r if weighted else None
    s = unit_output_importance(x, full, base, act, r)
    y = _forward(full, x)
    for j in range(full[0].shape[0]):
        # unit j falls back to the base: its gate row, up row and down column take the base values
        g, u, d = (t.clone() for t in full)
        g[j], u[j], d[:, j] = base[0][j], base[1][j], base[2][:, j]
        err = (y - _forward((g, u, d), x)).pow(2).sum(1)
        if r is not None:
            err = err * r.pow(2)
        assert float(s[j]) == pytest.approx(float(err.mean()), rel=1e-4, abs=1e-6)


def test_select_units_layer_wide_top_k_with_minimum_per_expert():
    scores = torch.zeros(4, 10)
    scores[0] = torch.arange(10, 20).float()  # expert 0 dominates
    scores[1:] = torch.rand(3, 10)
    mask = select_units(scores, 0.3, min_per_expert=2)
    assert int(mask.sum()) == 12
    assert (mask.sum(1) >= 2).all()
    # 8 units go to the minimums, the other 4 to the layer-wide best: expert 0's top 6
    assert mask[0].tolist() == [False] * 4 + [True] * 6
    assert int(mask[1:].sum()) == 6
    assert int(select_units(scores, 1.0).sum()) == 40
    no_min = select_units(scores, 0.25, min_per_expert=0)
    assert no_min[0].all() and int(no_min[1:].sum()) == 0


def test_select_elements_splits_the_budget_across_matrices():
    g, u, d = torch.rand(2, 3, 4), torch.rand(2, 3, 4), torch.rand(2, 4, 3)
    mg, mu, md = select_elements((g, u, d), 0.5, min_per_expert=0)
    assert mg.shape == g.shape and md.shape == d.shape
    assert int(mg.sum() + mu.sum() + md.sum()) == 36
    kept = torch.cat([g[mg], u[mu], d[md]])
    dropped = torch.cat([g[~mg], u[~mu], d[~md]])
    assert kept.min() >= dropped.max()
    g[1] = 0  # expert 1 scores nothing: the per-expert minimum still keeps some of it
    mg, mu, md = select_elements((g, u, d), 0.1, min_per_expert=3)
    assert int(mg[1].sum() + mu[1].sum() + md[1].sum()) >= 3


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, "x", None])
def test_keep_ratio_outside_unit_interval_is_rejected(bad):
    with pytest.raises(ValueError, match=r"keep_ratio must be .*\(0, 1\]"):
        check_keep_ratio(bad)


def test_unstructured_scores_spread_each_unit_importance_over_its_entries():
    from conftest import tiny_model

    from parser_moe import calibrate, element_scores_from_units, layer_output_importance, prepare

    model = tiny_model("qwen2_moe")
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    plan = prepare(model, calibrate(model, ids), "mean")
    ly = plan.layers[0]
    dec, cal = plan.decomps[ly.name], plan.calib.layers[ly.name]
    units = layer_output_importance(dec, cal, ly.act_fn)
    g, u, d = element_scores_from_units(units, dec, cal, ly.act_fn)
    assert g.shape == dec.res_gate.shape and d.shape == dec.res_down.shape
    torch.testing.assert_close(g.sum(2) + u.sum(2) + d.sum(1), units, rtol=1e-4, atol=1e-9)
    assert bool((g >= 0).all() and (d >= 0).all())
