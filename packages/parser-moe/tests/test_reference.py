"""The reference unit scores against the paper's formula, written out here from scratch."""

import torch
from conftest import tiny_model

from parser_moe import REFERENCE, Scoring, calibrate, prepare, reference_matches_formula
from parser_moe.pipeline import layer_scores


def _formula(x, gate_j, up_j, down_j, bgate_j, bup_j, bdown_j):
    """E_x ||h_f,j(x) d_f,j - h_b,j(x) d_b,j||^2 for one unit, token by token."""
    silu = torch.nn.functional.silu
    total = 0.0
    for t in range(x.shape[0]):
        xt = x[t].double()
        h_full = silu(xt @ gate_j) * (xt @ up_j)
        h_base = silu(xt @ bgate_j) * (xt @ bup_j)
        total += float((h_full * down_j - h_base * bdown_j).pow(2).sum())
    return total / x.shape[0]


def test_reference_scores_equal_the_formula_computed_unit_by_unit():
    model = tiny_model("qwen2_moe")
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(3))
    plan = prepare(model, calibrate(model, ids), "aligned")
    name = "model.layers.1.mlp.experts"
    ly = next(ly for ly in plan.layers if ly.name == name)
    experts = model.model.layers[1].mlp.experts  # fused: gate_up_proj [E, 2I, H], down_proj [E, H, I]
    inter = experts.down_proj.shape[2]
    dec, cal = plan.decomps[name], plan.calib.layers[name]
    ours = layer_scores(plan, ly, REFERENCE)
    for e in range(experts.gate_up_proj.shape[0]):
        gu = experts.gate_up_proj[e].detach().double()
        down = experts.down_proj[e].detach().double()
        for j in range(inter):
            src = int(dec.perms[e, j])  # the aligned base matched original unit src to position j
            want = _formula(
                cal.inputs[e],
                gu[src],
                gu[inter + src],
                down[:, src],
                dec.base_gate[j].double(),
                dec.base_up[j].double(),
                dec.base_down[:, j].double(),
            )
            assert abs(float(ours[e, j]) - want) <= 1e-4 * max(want, 1e-6), (e, j)


def test_formula_check_reports_a_match_and_catches_a_different_score(monkeypatch):
    model = tiny_model("qwen2_moe")
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(4))
    plan = prepare(model, calibrate(model, ids), "mean")
    ok = reference_matches_formula(model, plan)
    assert ok["matches"] and ok["max_rel_error"] < 1e-5 and ok["units"] == 2 * 4 * 16
    import parser_moe.verify as verify

    real = verify.layer_scores
    # routing-weighted scores are a different quantity: the check must say so
    monkeypatch.setattr(verify, "layer_scores", lambda p, ly, s: real(p, ly, Scoring("output", True, False)))
    plan._scores.clear()
    assert reference_matches_formula(model, plan)["matches"] is False
