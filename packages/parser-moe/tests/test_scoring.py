import pytest
import torch
from conftest import tiny_model

from parser_moe import REFERENCE, VARIANTS, Scoring, calibrate, compress_model, compressed_modules, prepare
from parser_moe.baselines import unit_scores
from parser_moe.importance import layer_output_importance
from parser_moe.pipeline import layer_scores


@pytest.fixture(scope="module")
def plan():
    model = tiny_model("qwen2_moe")
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    return model, prepare(model, calibrate(model, ids), "aligned")


def test_reference_is_the_published_configuration():
    assert REFERENCE == Scoring("output", route_weight=False, routed_share=False, min_per_expert=4)
    assert VARIANTS["reference"] == (REFERENCE,)
    assert all(c.min_per_expert == 4 for cands in VARIANTS.values() for c in cands)  # same selection rule
    assert len(VARIANTS["parser"]) == len(VARIANTS["wanda_routed"])  # the baseline gets the same tuning grid


def test_scores_follow_their_definitions(plan):
    model, p = plan
    ly = p.layers[0]
    dec, cal = p.decomps[ly.name], p.calib.layers[ly.name]
    plain = layer_output_importance(dec, cal, ly.act_fn, weighted=False, by_frequency=False)
    torch.testing.assert_close(layer_scores(p, ly, REFERENCE), plain)
    share = torch.tensor(cal.routed, dtype=torch.float32) / sum(cal.routed)
    torch.testing.assert_close(layer_scores(p, ly, Scoring("output", routed_share=True)), plain * share[:, None])
    wanda = unit_scores("wanda", dec, cal, ly.act_fn)
    torch.testing.assert_close(layer_scores(p, ly, Scoring("output_wanda")), (plain * wanda).sqrt())
    # route weighting of Wanda: its norms are over r * x, which for r == 1 changes nothing
    torch.testing.assert_close(unit_scores("wanda", dec, cal, ly.act_fn, route_weight=False), wanda)
    routed = unit_scores("wanda", dec, cal, ly.act_fn, route_weight=True)
    assert not torch.allclose(routed, wanda)


def test_every_variant_compresses_to_the_same_bytes_with_at_least_the_minimum_per_expert(plan):
    model, p = plan
    sizes = set()
    for cands in VARIANTS.values():
        for c in cands:
            cm = compress_model(model, p, c, 0.5)
            mods = compressed_modules(cm).values()
            assert all(int(m.kept_units().min()) >= 4 for m in mods), c.label()
            sizes.add(sum(m.nbytes() for m in mods))
    assert len(sizes) == 1


def test_an_expert_without_calibration_tokens_gets_finite_scores(plan):
    model, p = plan
    ly = p.layers[0]
    cal = p.calib.layers[ly.name]
    saved = (cal.inputs[1], cal.weights[1], cal.routed[1])
    cal.inputs[1], cal.weights[1], cal.routed[1] = cal.inputs[1][:0], cal.weights[1][:0], 0
    try:
        dec = p.decomps[ly.name]
        from parser_moe.scoring import score_entries, score_units

        for cands in VARIANTS.values():
            for c in cands:
                s = score_units(c, dec, cal, ly.act_fn)
                assert torch.isfinite(s).all(), c.label()
                if c.criterion != "magnitude":
                    assert float(s[1].abs().max()) == 0.0, c.label()  # no routed input: no output error
                assert all(torch.isfinite(t).all() for t in score_entries(c, dec, cal, ly.act_fn))
    finally:
        cal.inputs[1], cal.weights[1], cal.routed[1] = saved


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"criterion": "random"}, "criterion must be one of"),
        ({"criterion": "magnitude", "routed_share": True}, "uses no data"),
        ({"min_per_expert": -1}, "min_per_expert must be >= 0"),
    ],
)
def test_bad_scorings_are_rejected(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        Scoring(**kwargs)
