import pytest

from xronos.waits import segment_compute, step_waits


def _rec(t0, t1, syncs):
    return {"t0": t0, "t1": t1, "step_s": t1 - t0, "comm_s": sum(s[3] - s[2] for s in syncs), "syncs": syncs}


def test_allreduce_wait_is_time_until_the_last_rank_arrives():
    # rank 0 enters at 1.0, rank 1 at 1.4; both leave at 1.5: rank 0 waited 0.4, both transferred 0.1
    r0 = _rec(0.0, 2.0, [("ar", -1, 1.0, 1.5, "attn")])
    r1 = _rec(0.0, 2.3, [("ar", -1, 1.4, 1.5, "attn")])
    w = step_waits([r0, r1])
    assert w[0]["wait_s"] == pytest.approx(0.4 + 0.3)  # plus finishing 0.3 s before rank 1
    assert w[1]["wait_s"] == pytest.approx(0.0)
    assert w[0]["transfer_s"] == pytest.approx(0.1) and w[1]["transfer_s"] == pytest.approx(0.1)
    assert w[0]["step_s"] == pytest.approx(2.3) and w[0]["early_s"] == pytest.approx(0.3)


def test_p2p_waits_pair_the_kth_send_with_the_kth_receive():
    r0 = _rec(0.0, 3.0, [("send", 1, 1.0, 1.1, "pp"), ("send", 1, 2.0, 2.6, "pp")])
    r1 = _rec(0.0, 3.0, [("recv", 0, 0.5, 1.1, "pp"), ("recv", 0, 2.5, 2.6, "pp")])
    w = step_waits([r0, r1])
    assert w[1]["wait_s"] == pytest.approx(0.5)  # first receive posted 0.5 s before the data was sent
    assert w[0]["wait_s"] == pytest.approx(0.5)  # second send waited 0.5 s for the receive
    assert w[0]["transfer_s"] == pytest.approx(0.1 + 0.1) and w[1]["transfer_s"] == pytest.approx(0.1 + 0.1)


def test_mismatched_collectives_are_an_error():
    with pytest.raises(ValueError, match="different numbers of all-reduces"):
        step_waits([_rec(0, 1, [("ar", -1, 0.1, 0.2, "")]), _rec(0, 1, [])])


def test_segment_compute_charges_each_segment_to_the_sync_that_closes_it():
    syncs = [
        ("ar", -1, 0.3, 0.4, "attn"),
        ("ar", -1, 0.6, 0.7, "mlp"),
        ("ar", -1, 0.8, 0.9, "head"),
        ("ar", -1, 1.2, 1.3, "mlp"),
        ("ar", -1, 1.5, 1.6, "attn"),
        ("ar", -1, 1.7, 1.8, "clip"),
    ]
    seg = segment_compute(_rec(0.0, 2.0, syncs), num_layers=1)
    assert seg == pytest.approx({"attn": 0.3 + 0.2, "mlp": 0.2 + 0.3, "other": 0.1 + 0.1 + 0.2})
    assert segment_compute(_rec(0.0, 2.0, syncs), num_layers=2) is None  # not every layer seen
    assert segment_compute(_rec(0.0, 1.0, [("send", 1, 0.1, 0.2, "pp")])) is None


def test_segment_jitter_is_the_median_coefficient_of_variation():
    from xronos.waits import segment_jitter

    def rec(first, second):  # two compute segments, each ended by a 1 ms all-reduce
        return {
            "t0": 0.0,
            "syncs": [
                ("ar", -1, first, first + 0.001, "attn"),
                ("ar", -1, first + 0.001 + second, first + 0.002 + second, "mlp"),
            ],
        }

    steady = [rec(0.010, 0.020) for _ in range(4)]
    assert segment_jitter(steady) == 0.0
    noisy = [rec(0.010, s) for s in (0.018, 0.022, 0.018, 0.022)]
    assert segment_jitter(noisy) == pytest.approx(0.05)  # median of CVs 0 and 0.1
    assert segment_jitter(noisy[:2]) is None  # too few steps
