import json

import pytest

from sysprdict.dataset import DatasetError, load_rows, save_rows
from sysprdict.profile import GridPoint, ProfileError, _run_ddp, profile_grid, run_point


def _row(**kw):
    r = {
        "model": "llama-xs",
        "family": "llama",
        "modality": "text",
        "batch": 2,
        "seq_len": 16,
        "image_size": 32,
        "precision": "fp32",
        "optimizer": "adamw",
        "checkpointing": False,
        "world_size": 1,
        "step_time_s": 0.01,
        "step_cpu_s": 0.005,
        "peak_bytes": 1234,
    }
    r.update(kw)
    return r


def test_round_trip(tmp_path):
    rows = [_row(), _row(precision="bf16", peak_bytes=99)]
    p = save_rows(tmp_path / "d.jsonl", rows, {"note": "x"})
    header, back = load_rows(p)
    assert header["version"] == 1 and header["note"] == "x"
    assert back == rows


def test_corrupt_lines_name_the_line(tmp_path):
    p = save_rows(tmp_path / "d.jsonl", [_row(), _row()])
    lines = p.read_text().splitlines()
    lines[2] = lines[2][:-5]
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=r"d.jsonl:3: not valid JSON"):
        load_rows(p)
    lines[2] = json.dumps(_row(batch="two"))
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetError, match=r"d.jsonl:3: field 'batch'"):
        load_rows(p)
    p.write_text('{"format": "other"}\n')
    with pytest.raises(DatasetError, match=r":1: missing header"):
        load_rows(p)
    with pytest.raises(DatasetError, match="row 0"):
        save_rows(tmp_path / "e.jsonl", [{"model": "x"}])


def test_run_point_measures_a_real_step():
    r = run_point(GridPoint("vit-xs", 2, 16, 32, "bf16", "sgd"), steps=1)
    assert r["peak_bytes"] > 0 and r["step_cpu_s"] > 0 and r["emulated"] is False
    assert r["breakdown"]["Parameter"] > 0


def test_profile_grid_interleaves_timing_rounds():
    pts = [GridPoint("vit-xs", 2, 16, 32, "fp32", "sgd"), GridPoint("llama-xs", 1, 16, 32, "bf16", "adamw")]
    rows = profile_grid(pts, steps=2, progress=False, rounds=3)
    assert [r["model"] for r in rows] == ["vit-xs", "llama-xs"]
    for r in rows:
        assert r["rounds"] == 3 and len(r["step_times_s"]) == 6 and r["peak_bytes"] > 0
        assert r["step_cpu_s"] > 0
    with pytest.raises(ValueError, match="rounds"):
        profile_grid(pts, rounds=0, progress=False)


def test_grid_point_validation():
    with pytest.raises(ValueError, match="precision"):
        GridPoint("llama-xs", 2, precision="fp8")
    with pytest.raises(ValueError, match="model"):
        GridPoint("bert-s", 2)


@pytest.mark.slow
def test_data_parallel_gloo_two_ranks():
    r = run_point(GridPoint("llama-xs", 2, 16, world_size=2), steps=1, timeout_s=240)
    assert r["world_size"] == 2 and r["step_time_s"] > 0
    assert r["allreduce_bandwidth_bytes_per_s"] > 0


@pytest.mark.slow
def test_dead_rank_is_named():
    # an invalid precision inside the ranks (bypassing GridPoint validation) kills them
    p = GridPoint("llama-xs", 2, world_size=2)
    object.__setattr__(p, "precision", "fp8")
    with pytest.raises(ProfileError, match="rank [01]"):
        _run_ddp(p, 1, 120)
