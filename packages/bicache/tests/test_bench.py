import pytest

from bicache import depth
from bicache.bench import run_bench, variants


@pytest.mark.slow
def test_bench_runs_every_variant_side_by_side(dlm):
    cal = depth.calibrate(dlm, shared_rows=[0, 3, 6, 7], requests_per_fraction=2, groups=1)
    out = run_bench(
        dlm, repeats=1, max_batch=4, progress=False, calibration=cal, bound=0.05, workload=(1, 4), heap=False
    )
    names = [v[0] for v in variants(dlm)]
    assert list(out["results"]) == names
    for name in names:
        assert set(out["results"][name]) == {"0.25", "0.5", "0.75", "0.9"}
    h = out["headline"]
    for key in (
        "acc_nocache",
        "acc_naive_prefix",
        "acc_drop_bicache",
        "throughput_ratio_vs_nocache",
        "throughput_ratio_vs_block_cache",
        "throughput_ratio_vs_nocache@0.25",
        "throughput_ratio_vs_nocache@0.9",
    ):
        assert key in h
    # fewer token-layers computed with prefix reuse than without (same requests, same decoding)
    r = out["results"]
    assert r["naive_prefix"]["0.9"]["token_layers_computed"] < r["nocache"]["0.9"]["token_layers_computed"]
    assert r["block_cache"]["0.9"]["token_layers_computed"] < r["nocache"]["0.9"]["token_layers_computed"]
    assert r["fixed_depth_1"]["0.9"]["depths"] == [1]
    assert h["acc_drop_bicache"] == pytest.approx(h["acc_nocache"] - h["acc_bicache"], abs=1e-4)
    # against Fast-dLLM's dual cache (the block cache) alone, at a 50% shared prefix
    dual, both = r["block_cache"]["0.5"], r["bicache+block_cache"]["0.5"]
    ratio = (both["tokens"] / both["median_cpu_seconds"]) / (dual["tokens"] / dual["median_cpu_seconds"])
    assert h["throughput_ratio_vs_dual_cache"] == pytest.approx(ratio, abs=1e-3)
    assert h["acc_drop_vs_dual_cache"] == pytest.approx(dual["accuracy"] - both["accuracy"], abs=1e-4)
