import math

import pytest

from hwtopo import (
    SpecError,
    format_bandwidth,
    format_bytes,
    parse_bandwidth,
    parse_bytes,
    parse_duration,
    parse_flops,
)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("16GiB", 16 * 2**30),
        ("512MB", 512e6),
        ("1.5 KiB", 1536),
        ("100", 100),
        ("4kB", 4000),
        ("2TiB", 2 * 2**40),
        (4096, 4096),
        (0, 0),
    ],
)
def test_bytes(text, expected):
    assert parse_bytes(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("10Gbps", 1.25e9),
        ("1Gbit/s", 1.25e8),
        ("300Mbps", 300e6 / 8),
        ("2GB/s", 2e9),
        ("800MiB/s", 800 * 2**20),
        ("5MBps", 5e6),
        (1e9, 1e9),
    ],
)
def test_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text,expected", [("25ms", 0.025), ("2us", 2e-6), ("1.5s", 1.5), ("3min", 180), ("10ns", 1e-8), (0.1, 0.1)]
)
def test_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text,expected", [("1.2TFLOPS", 1.2e12), ("989TFLOPS", 989e12), ("5GFLOP/s", 5e9), (3e9, 3e9)])
def test_flops(text, expected):
    assert parse_flops(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    "fn,bad,hint",
    [
        (parse_bandwidth, "10 Gbs", "10Gbps"),
        (parse_bandwidth, "fast", "10Gbps"),
        (parse_bytes, "16 gigs", "16GiB"),
        (parse_duration, "25 lightyears", "25ms"),
        (parse_flops, "1.2TB", "1.2TFLOPS"),
        (parse_bytes, True, "16GiB"),
        (parse_bytes, [1], "16GiB"),
    ],
)
def test_bad_units_name_field_and_example(fn, bad, hint):
    with pytest.raises(SpecError) as e:
        fn(bad, "links[2].bandwidth")
    assert e.value.field == "links[2].bandwidth"
    assert str(e.value).startswith("links[2].bandwidth: ")
    assert hint in str(e.value)


@pytest.mark.parametrize("fn", [parse_bytes, parse_bandwidth, parse_duration, parse_flops])
def test_negative_and_nonfinite_rejected(fn):
    with pytest.raises(SpecError, match="negative"):
        fn(-1, "x")
    with pytest.raises(SpecError, match="finite"):
        fn(math.inf, "x")


def test_format_round_numbers():
    assert format_bytes(16 * 2**30) == "16GiB"
    assert format_bandwidth(1.25e9) == "1.25GB/s"
