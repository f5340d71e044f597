"""The replay experiment's hand-written chains parse into the schedule its replays follow, or fail clearly."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "experiments" / "chain_replay.py"
_spec = importlib.util.spec_from_file_location("chain_replay", _PATH)
chain_replay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chain_replay)

TABLE = {"dp4-mb16-gb64": 900.0, "dp2-pp2-mb32-gb64": 1100.0, "dp4-mb32-gb128": 1400.0, "dp4-mb32-gb256": 1600.0}


def test_fixed_chain_takes_each_global_batch_on_its_fastest_strategy():
    by, sched = chain_replay._fixed("64:0,128:6,256:9.5", TABLE)
    assert by == "clock"
    assert sched == [(0.0, 64, "dp2-pp2-mb32-gb64"), (6.0, 128, "dp4-mb32-gb128"), (9.5, 256, "dp4-mb32-gb256")]
    assert chain_replay._table({"probe": {"throughput": {n: {"samples_per_s": v} for n, v in TABLE.items()}}}) == TABLE


@pytest.mark.parametrize(
    "spec, message",
    [
        ("64", "must be global_batch:clock_s"),
        ("x:0", "must be global_batch:clock_s"),
        ("64:soon", "must be global_batch:clock_s"),
        ("64:0,512:3", "no strategy of global batch 512"),
        ("64:1,128:3", "must start at clock 0"),
        ("64:0,128:6,256:3", "clocks must increase"),
    ],
)
def test_fixed_chain_errors_name_the_entry(spec, message):
    with pytest.raises(ValueError, match=message):
        chain_replay._fixed(spec, TABLE)
