"""The fault and attack sweep (safety.py) over every package: every bad count is zero.

The full corpus of malformed command lines and every loader run as `nox -s bench` runs them; the
kvpool kill -9 loops and races are shorter here (the bench runs the issue's sizes). The first tests
show that each counter does count: a suite whose counters could not fail would prove nothing.
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from pathlib import Path

import pytest
import safety

import hwtopo


def _bad(res: dict, part: str) -> dict:
    return {k: res[k] for k in safety.BAD[part] if res.get(k)}


# ------------------------------------------------------------------- the counters count ---


def test_a_traceback_an_escaped_exit_and_a_slow_command_are_each_seen():
    r = safety.call_main(lambda argv: 1 / 0, [])
    assert (
        r["code"] is None and "Traceback (most recent call last)" in r["stderr"] and "ZeroDivisionError" in r["stderr"]
    )
    assert safety.call_main(lambda argv: sys.exit("boom"), [])["code"] == 1
    assert safety.call_main(lambda argv: 2, [])["code"] == 2
    r = safety.call_main(lambda argv: time.sleep(30), [], alarm_s=1)
    assert r["slow"] and r["code"] is None


def test_the_cli_counters_flag_a_cli_that_accepts_creates_or_unpickles(tmp_path):
    def accepting(argv):
        return 0

    def creating(argv):
        for a in argv:
            if "/absent/" in a:
                Path(a).mkdir(parents=True)
        return 2

    def unpickling(argv):
        for a in argv:
            if a.endswith("payload.json"):
                pickle.loads(Path(a).read_bytes())
        return 2

    def lines(package, placeholder=""):
        return sum(placeholder in line for line in safety.CORPUS[package].strip().splitlines())

    assert safety.cli_counts("hwtopo", tmp_path, main=accepting)["bad_exit"] == lines("hwtopo")
    assert safety.cli_counts("xronos", tmp_path, main=creating)["created"] == lines("xronos", "<absent>") > 0
    assert (
        safety.cli_counts("geomesh", tmp_path, main=unpickling)["code_executed"]
        == lines("geomesh", "<pickle_json>")
        > 0
    )


def test_a_loader_that_unpickles_is_counted(tmp_path, monkeypatch):
    assert safety.payload_is_live(tmp_path)

    def unsafe(d, marker):
        pickle.loads(safety.write_payload(d / "x.pkl", marker, torch_format=False).read_bytes())

    monkeypatch.setitem(safety.LOADERS, "hwtopo", {"unsafe": unsafe})
    res = safety.loader_counts("hwtopo", tmp_path)
    assert res == {"payloads": 1, "code_executed": 1, "outcomes": {"unsafe": "loaded"}}
    assert safety.bad_counts({"hwtopo": {"loaders": res}}) == ["hwtopo.loaders.code_executed = 1"]


# ------------------------------------------------------------------------- the sweep ---


def test_the_corpus_has_at_least_100_inputs_and_12_per_console_script():
    sizes = {p: len(safety.CORPUS[p].strip().splitlines()) for p in safety.PACKAGES}
    assert sum(sizes.values()) >= 100 and min(sizes.values()) >= 12, sizes


@pytest.mark.parametrize("package", safety.PACKAGES)
def test_malformed_command_lines_fail_cleanly_and_early(package, tmp_path):
    res = safety.cli_counts(package, tmp_path)
    assert res["inputs"] >= 12
    assert not _bad(res, "cli"), json.dumps(res["failures"], indent=1)


@pytest.mark.parametrize("package", safety.PACKAGES)
def test_no_loader_runs_a_crafted_pickle(package, tmp_path):
    res = safety.loader_counts(package, tmp_path)
    assert res["payloads"] >= 1 and res["code_executed"] == 0, res["outcomes"]


@pytest.mark.parametrize("package", sorted(safety.LAUNCHERS))
def test_nothing_outlives_a_sigkilled_launcher_or_emulator(package, tmp_path):
    res = safety.leftover_counts(package, tmp_path)
    assert not res["errors"] and not _bad(res, "leftovers"), res["runs"]
    runs = res["runs"]
    # the scenarios were real where the machine allows them: a throttled rank, namespaces, a stop
    if package == "xronos" and hwtopo.cgroup_available():
        assert runs["launcher"]["cgroups_made"] >= 1
    if package == "geomesh" and "launcher" not in res["skipped"]:
        assert runs["launcher"]["namespaces_held"] == 3
    if package == "hwtopo":
        assert runs["throttle_creator"]["stopped_at_kill"]
        assert "cgroup_creator" in res["skipped"] or runs["cgroup_creator"]["cgroups_made"] >= 1


def test_kvpool_returns_no_wrong_bytes_and_loses_no_acknowledged_write():
    res = safety.kvpool_faults(pairs=300, kills=4)
    assert not _bad(res, "faults"), res["runs"]
    assert res["runs"]["kill9"]["acked"] > 0 and res["sizes"] == {"pairs": 300, "kills": 4}


def test_the_script_writes_its_counts_as_json(tmp_path):
    out = tmp_path / "safety.json"
    assert safety.main(["--json", str(out), "--only", "geomesh"]) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"geomesh", "measured_at", "machine"}
    assert report["geomesh"]["cli"]["inputs"] >= 12 and report["geomesh"]["loaders"]["payloads"] >= 1
    assert safety.bad_counts(report) == []


def _make_results():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "docs" / "make_results.py"
    spec = importlib.util.spec_from_file_location("make_results", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_results_page_shows_the_counts_of_every_package_swept():
    mr = _make_results()
    cli = {"inputs": 17, "tracebacks": 0, "bad_exit": 1, "slow": 0, "created": 0, "code_executed": 0}
    kv = {
        "cli": cli,
        "loaders": {"payloads": 1, "code_executed": 0},
        "faults": {"wrong_bytes": 0, "lost_acked_writes": 3},
    }
    bench = {"kvpool": {"version": "1", "headline": {}, "safety": {"suite": kv, "bench": {"wrong_bytes": 0}}}}
    sweep = {
        "hwtopo": {"cli": cli, "loaders": {"payloads": 1, "code_executed": 1}, "leftovers": {"cgroups": 2}},
        "kvpool": {"cli": {"inputs": 99}},  # the bench entry's copy wins
        "machine": "vm",
    }
    page = mr.render(bench, "now", "", sweep)
    assert "## Safety" in page
    assert "| hwtopo | 17 | 1 | 0 | 1 | 0 | 0 | 1 | 2 | - | - |" in page
    assert "| kvpool | 17 | 1 | 0 | 1 | 0 | 0 | 0 | - | 0 | 3 |" in page
    assert "## Safety" not in mr.render({"kvpool": {"version": "1", "headline": {}}}, "now")


def test_guides_and_readmes_get_the_measured_table_between_their_markers(tmp_path):
    mr = _make_results()
    guides, pkgs = tmp_path / "guides", tmp_path / "packages"
    guides.mkdir()
    (pkgs / "kvpool").mkdir(parents=True)
    marked = f"# kvpool\n\nintro\n\n{mr.BEGIN}\nold table\n{mr.END}\n\nafter\n"
    (guides / "kvpool.md").write_text(marked)
    (pkgs / "kvpool" / "README.md").write_text(marked)
    (pkgs / "bicache").mkdir()
    (pkgs / "bicache" / "README.md").write_text("# bicache\n\nno markers\n")
    bench = {
        "kvpool": {"headline": {"ttft_ratio_vs_best_equal_bw": 0.5}, "conditions": "a loaded machine"},
        "bicache": {"headline": {"x": 1.0}},
    }
    done = mr.update_guides(bench, guides, pkgs)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in done) == ["guides/kvpool.md", "packages/kvpool/README.md"]
    for page in done:
        text = page.read_text()
        assert "old table" not in text and "| `ttft_ratio_vs_best_equal_bw` | 0.5 |" in text
        assert "Conditions: a loaded machine" in text
        assert text.startswith("# kvpool\n\nintro\n") and text.endswith("\n\nafter\n")
    assert (pkgs / "bicache" / "README.md").read_text() == "# bicache\n\nno markers\n"
