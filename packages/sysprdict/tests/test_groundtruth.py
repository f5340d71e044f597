"""The ground-truth harness: real peak memory and step time, one process per configuration."""

import pytest

from sysprdict.groundtruth import GroundTruthError, measure

MiB = 1 << 20


def test_peak_of_a_known_buffer():
    # a workload whose peak is known: the harness must see the buffer's pages, not less, and the
    # difference between two sizes must be the difference of the buffers (the constant runtime
    # cost of a first torch op cancels)
    small = measure("sysprdict.groundtruth:touch_buffer", {"nbytes": 16 * MiB}, steps=2)
    large = measure("sysprdict.groundtruth:touch_buffer", {"nbytes": 80 * MiB}, steps=2)
    assert small.cpu_peak_bytes >= 16 * MiB and large.cpu_peak_bytes >= 80 * MiB
    assert large.cpu_peak_bytes - small.cpu_peak_bytes == pytest.approx(64 * MiB, rel=0.03)
    assert small.cpu_peak_bytes < 16 * MiB + 32 * MiB  # the runtime's own share stays small
    assert large.threads == 1 and len(large.step_times_s) == 2 and large.step_time_s > 0
    assert large.gpu_max_reserved_bytes is None and large.device == "cpu"


def test_each_configuration_gets_a_fresh_process():
    # a freed buffer of the first run must not lower (or raise) the second run's peak
    first = measure("sysprdict.groundtruth:touch_buffer", {"nbytes": 48 * MiB}, steps=1)
    second = measure("sysprdict.groundtruth:touch_buffer", {"nbytes": 48 * MiB}, steps=1)
    assert second.cpu_peak_bytes == pytest.approx(first.cpu_peak_bytes, rel=0.05)
    assert second.rss_before_bytes > 0


def test_training_step_real_peak_exceeds_tensor_accounting():
    m = measure(
        "sysprdict.groundtruth:training_step",
        {"model": "llama-xs", "batch": 2, "seq_len": 16, "precision": "fp32", "optimizer": "adamw"},
        steps=1,
        diagnostic=True,
    )
    assert m.tensor_accounting_bytes and m.tensor_accounting_bytes > 0
    # the process pays the tensors plus the runtime around them
    assert m.cpu_peak_bytes > m.tensor_accounting_bytes
    assert m.step_cpu_s > 0


def test_failures_are_reported_by_configuration():
    with pytest.raises(GroundTruthError, match="no-such-model"):
        measure("sysprdict.groundtruth:training_step", {"model": "no-such-model", "batch": 1}, steps=1)
    with pytest.raises(ValueError, match="builder"):
        measure("not-a-builder", {}, steps=1)
    with pytest.raises(GroundTruthError, match="exceeds .* cpu has available; not started"):
        measure("sysprdict.groundtruth:touch_buffer", {"nbytes": 1 << 60}, predicted_bytes=float(1 << 60))
    with pytest.raises(ValueError, match="steps"):
        measure("sysprdict.groundtruth:touch_buffer", {"nbytes": 1}, steps=0)
    with pytest.raises(ValueError, match="min_time_s"):
        measure("sysprdict.groundtruth:touch_buffer", {"nbytes": 1}, min_time_s=-1.0)


def test_short_steps_are_timed_until_the_minimum_time():
    # a microsecond step cannot fill a minute: it is timed MAX_STEPS_FACTOR x steps times, no more
    from sysprdict.groundtruth import MAX_STEPS_FACTOR

    capped = measure("sysprdict.groundtruth:touch_buffer", {"nbytes": 1024}, steps=2, min_time_s=60.0)
    assert len(capped.step_times_s) == 2 * MAX_STEPS_FACTOR
    plain = measure("sysprdict.groundtruth:touch_buffer", {"nbytes": 1024}, steps=2)
    assert len(plain.step_times_s) == 2
