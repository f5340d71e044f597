import pytest

import hwtopo
from geomesh.simulate import (
    SCHEMES,
    WireOverhead,
    fit_overhead,
    messages_per_sync,
    scaling,
    scheme_of,
    sign_payload_bytes,
    simulate,
    validate,
)
from geomesh.wan import WanEmulator

N = 107_000


def test_sign_reduce_scatter_traffic_stays_flat_while_the_all_gather_grows():
    c = hwtopo.load("geo-3region")
    rs = [simulate(c, n, N, "reduce-scatter-sign").wire_bytes_per_worker for n in (3, 8, 64)]
    ag = [simulate(c, n, N, "allgather-sign").wire_bytes_per_worker for n in (3, 8, 64)]
    s = sign_payload_bytes(N)
    assert ag == [2 * s, 7 * s, 63 * s]
    assert all(r < 2 * sign_payload_bytes(N, shards=64) for r in rs)
    ring = simulate(c, 64, N, "ring-fp32")
    assert ring.wire_bytes_per_worker == pytest.approx(2 * 63 / 64 * 4 * N)
    table = scaling(c, N)
    assert table["ratios"]["reduce-scatter-sign_traffic_vs_ring_fp32@64"] <= 1 / 8
    assert table["ratios"]["allgather-sign_traffic_vs_ring_fp32@64"] > 1 / 8
    assert set(table["schemes"]) == set(SCHEMES) and table["workers"] == [3, 8, 16, 32, 64]


def test_simulated_time_is_the_emulators_link_model():
    c = hwtopo.load("geo-3region")
    cost = simulate(c, 3, N, "ring-fp32")
    wan = WanEmulator(c, c.names)
    assert cost.time_s == wan.model_time_s("all_reduce", 4 * N)
    # round-robin placement: 6 workers put two on every machine, each ring hop still crosses a WAN link
    assert simulate(c, 6, N, "allgather-sign").time_s > simulate(c, 3, N, "allgather-sign").time_s


def test_validate_reports_relative_errors_and_scheme_names():
    c = hwtopo.load("geo-3region")
    model = simulate(c, 3, N, "allgather-sign")
    got = validate(c, N, {"allgather-sign": {"workers": 3, "wire_bytes": 1.1 * model.wire_bytes_per_worker}})
    row = got["allgather-sign"]
    assert row["wire_bytes_rel_err"] == pytest.approx(0.1) and row["collective_s_rel_err"] is None
    assert scheme_of("geomesh", "all_gather") == "allgather-sign"
    assert scheme_of("geomesh-rs", "reduce_scatter+all_gather") == "reduce-scatter-sign"
    assert scheme_of("diloco-fp16", "all_reduce_gather") == "gather-fp16"
    assert scheme_of("ddp", "all_reduce") is None
    with pytest.raises(ValueError, match="scheme: 'tree' is not valid"):
        simulate(c, 3, N, "tree")
    with pytest.raises(ValueError, match="workers: 0 must be a positive integer"):
        simulate(c, 0, N, "ring-fp32")


def test_wire_overhead_is_fitted_per_byte_and_per_message():
    c = hwtopo.load("geo-3region")
    true = WireOverhead(per_byte=0.05, per_message=500.0)
    runs = {sc: simulate(c, 3, N, sc, overhead=true) for sc in ("allgather-sign", "gather-fp32", "ring-fp32")}
    measured = {sc: {"workers": 3, "wire_bytes": r.wire_bytes_per_worker} for sc, r in runs.items()}
    got = fit_overhead(N, measured)
    assert got.per_byte == pytest.approx(0.05) and got.per_message == pytest.approx(500.0)
    # 2 meta messages and the ring's 4 steps
    assert messages_per_sync("ring-fp32", 3) == 6 and messages_per_sync("allgather-sign", 3) == 4
    assert runs["ring-fp32"].wire_bytes_per_worker == pytest.approx(
        runs["ring-fp32"].traffic_bytes_per_worker * 1.05 + 6 * 500.0
    )
    # one run: the whole excess is per message; no measured bytes: no overhead
    one = fit_overhead(N, {"allgather-sign": measured["allgather-sign"]})
    assert one.per_byte == 0 and one.per_message > 0
    assert fit_overhead(N, {"allgather-sign": {"workers": 3, "wire_bytes": None}}) == WireOverhead()
