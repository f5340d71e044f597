"""The bench's headline arithmetic on made-up measurements: medians, dev-only selection, honesty flags."""

import pytest

from parser_moe.bench import _headline
from parser_moe.scoring import VARIANTS

RATIOS = (0.1, 0.2)


def _run(gaps: dict, dev: dict, tasks: dict):
    run = {"uncompressed": {"ppl": 5.0, "gap": 0.0, "tasks": {"mean": tasks["full"]}}}
    for r in RATIOS:
        for name in VARIANTS:
            row = {"gap": gaps[name] * (2 if r == 0.1 else 1), "expert_bytes": 100 + int(r * 10)}
            row["memory_reduction"] = 0.5
            row["dev_gaps"] = {"x": dev.get(name, 1.0)}
            if r == 0.2 and name in tasks:
                row["tasks"] = {"mean": tasks[name]}
            run[f"{name}@{r}"] = row
    return run


def _about():
    return {"formula_check": {"matches": True, "max_rel_error": 1e-7}}


def test_headline_takes_medians_of_per_model_ratios_and_chooses_the_best_variant_on_dev():
    base = {"reference": 1.0, "magnitude": 1.5, "reconstruction": 1.6, "wanda": 0.9, "wanda_routed": 0.9}
    tasks = {"full": 0.5, "reference": 0.4, "wanda": 0.45, "parser": 0.48, "output_wanda": 0.3}
    runs = [
        # output_wanda is best on test but worse on dev: the headline must not pick it
        _run(
            {**base, "parser": 0.8, "output_wanda": 0.5}, {"reference": 1.0, "parser": 0.7, "output_wanda": 0.9}, tasks
        ),
        _run(
            {**base, "wanda": 1.2, "parser": 0.6, "output_wanda": 0.5},
            {"reference": 1.0, "parser": 0.7, "output_wanda": 0.9},
            tasks,
        ),
        _run(
            {**base, "wanda": 0.8, "parser": 0.7, "output_wanda": 0.5},
            {"reference": 1.0, "parser": 0.7, "output_wanda": 0.9},
            tasks,
        ),
    ]
    head, spread = _headline(runs, [_about()] * 3, RATIOS)
    assert head["best_variant"] == "parser"
    assert head["gap_ratio_vs_magnitude_reference@0.1"] == pytest.approx(1.5)
    assert spread["gap_ratio_vs_wanda_reference@0.2"]["per_model"] == pytest.approx([0.9, 1.2, 0.8])
    assert head["gap_ratio_vs_wanda_reference@0.2"] == pytest.approx(0.9)
    assert head["reference_beats_wanda@0.2"] is False
    assert head["reference_loses_to_wanda_on_models@0.2"] == "2 of 3"
    assert head["gap_ratio_vs_wanda_best@0.2"] == pytest.approx(statistics_median([0.9 / 0.8, 1.2 / 0.6, 0.8 / 0.7]))
    assert head["gap_ratio_vs_wanda"] == pytest.approx(
        min(head["gap_ratio_vs_wanda_best@0.1"], head["gap_ratio_vs_wanda_best@0.2"])
    )
    assert head["task_acc_drop_reference@0.2"] == pytest.approx(0.1)
    assert head["task_acc_drop_wanda@0.2"] == pytest.approx(0.05)
    assert head["task_acc_drop_best@0.2"] == pytest.approx(0.02)
    assert head["memory_equal_across_methods"] is True and head["reference_matches_formula"] is True
    assert head["models"] == 3


def statistics_median(xs):
    import statistics

    return statistics.median(xs)


def test_a_zero_reference_gap_gives_null_ratios_not_infinity():
    base = {n: 1.0 for n in VARIANTS}
    run = _run(
        {**base, "reference": 0.0},
        {},
        {"full": 0.5, "reference": 0.5, "wanda": 0.5, "parser": 0.5, "output_wanda": 0.5},
    )
    head, spread = _headline([run], [_about()], RATIOS)
    assert head["gap_ratio_vs_magnitude_reference@0.1"] is None
    assert spread["gap_ratio_vs_magnitude_reference@0.1"]["min"] is None
