"""hwtopo.console: exit codes, common options, argument types, output paths, tables, progress."""

from __future__ import annotations

import io
import logging
import os

import pytest

from hwtopo import console


def _cli(handler):
    p, sub = console.parser("demo-cli", "a test program", "9.9")
    run = console.command(sub, "run", "do the thing")
    run.add_argument("--reps", type=console.positive_int("--reps", maximum=100), default=3, help="repetitions")
    run.add_argument("--rate", type=console.positive_float("--rate"), default=1.0)
    run.add_argument("--frac", type=console.fraction("--frac"), default=0.5)
    return lambda argv: console.run(p, {"run": handler}, argv)


def test_exit_codes_map_failures(capsys):
    def usage(args):
        raise console.UsageError("--out must be a file")

    def boom(args):
        raise RuntimeError("disk vanished")

    assert _cli(lambda a: 0)(["run"]) == 0
    assert _cli(usage)(["run"]) == 2
    assert "demo-cli: error: --out must be a file" in capsys.readouterr().err
    assert _cli(boom)(["run"]) == 1
    err = capsys.readouterr().err
    assert "demo-cli: error: disk vanished" in err and "Traceback" not in err
    assert _cli(boom)(["run", "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_quiet_and_debug_work_before_and_after_the_subcommand():
    seen = []
    cli = _cli(lambda a: seen.append((a.quiet, a.debug)))
    cli(["--quiet", "run"])
    cli(["run", "--debug"])
    cli(["run"])
    assert seen == [(True, False), (False, True), (False, False)]
    assert logging.getLogger().level == logging.WARNING


def test_version_and_help(capsys):
    cli = _cli(lambda a: 0)
    assert cli(["--version"]) == 0
    assert "demo-cli 9.9" in capsys.readouterr().out
    assert cli(["run", "--help"]) == 0
    assert "(default: 3)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--reps", "0"], "--reps must be an integer >= 1 and <= 100"),
        (["--reps", "101"], "--reps must be an integer >= 1 and <= 100"),
        (["--reps", "1e30"], "--reps must be an integer"),
        (["--reps", "two"], "--reps must be an integer"),
        (["--rate", "nan"], "--rate must be a number > 0"),
        (["--rate", "inf"], "--rate must be a number > 0"),
        (["--rate", "-1"], "--rate must be a number > 0"),
        (["--frac", "1.5"], "--frac must be a number >= 0 and <= 1"),
    ],
)
def test_numbers_out_of_range_are_usage_errors(argv, field, capsys):
    assert _cli(lambda a: 0)(["run", *argv]) == 2
    assert field in capsys.readouterr().err


def test_output_file_is_checked_without_creating_anything(tmp_path):
    assert console.output_file(tmp_path / "r.json", "--json") == tmp_path / "r.json"
    with pytest.raises(console.UsageError, match=r"--json .*does not exist"):
        console.output_file(tmp_path / "no" / "r.json", "--json")
    with pytest.raises(console.UsageError, match="is a directory"):
        console.output_file(tmp_path, "--json")
    assert not (tmp_path / "no").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_output_file_in_a_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(console.UsageError, match="not writable"):
        console.output_file(ro / "r.json", "--json")


def test_output_dir_creates_only_the_named_leaf(tmp_path):
    assert console.output_dir(tmp_path / "out", "--out").is_dir()
    with pytest.raises(console.UsageError, match="its parent .* does not exist"):
        console.output_dir(tmp_path / "a" / "b" / "c", "--out")
    assert not (tmp_path / "a").exists()
    (tmp_path / "f").write_text("x")
    with pytest.raises(console.UsageError, match="is not a directory"):
        console.output_dir(tmp_path / "f", "--out")


def test_table_is_markdown():
    text = console.table([["dp4", 1.5], ["tp2", 2]], ["plan", "ratio"])
    lines = text.splitlines()
    assert lines[0].split("|")[1].strip() == "plan" and set(lines[1]) <= set("|-: ")
    assert "dp4" in lines[2] and "1.5" in lines[2]


def test_progress_writes_whole_lines_when_not_a_terminal(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr("sys.stderr", buf)
    for _ in console.progress(range(3), desc="steps"):
        pass
    out = buf.getvalue()
    assert "\r" not in out and "steps" in out and "3/3" in out
    buf.truncate(0)
    list(console.progress(range(3), desc="steps", quiet=True))
    assert buf.getvalue() == ""


def test_cache_dir_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("MLSYSKIT_CACHE_DIR", str(tmp_path))
    assert console.cache_dir("kvpool") == tmp_path / "kvpool"
    monkeypatch.setenv("KVPOOL_CACHE", str(tmp_path / "own"))
    assert console.cache_dir("kvpool", "KVPOOL_CACHE") == tmp_path / "own"
    monkeypatch.delenv("MLSYSKIT_CACHE_DIR")
    monkeypatch.delenv("KVPOOL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert console.cache_dir("kvpool") == tmp_path / "xdg" / "mlsyskit" / "kvpool"


def test_atomic_file_appears_whole_or_not_at_all(tmp_path):
    import hwtopo

    target = tmp_path / "w.bin"
    hwtopo.atomic_write_bytes(target, b"old")
    with pytest.raises(RuntimeError):
        with hwtopo.atomic_file(target, "wb") as fh:
            fh.write(b"half of the new")
            raise RuntimeError("crash mid-write")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["w.bin"]
    with hwtopo.atomic_file(target) as fh:
        fh.write(b"new")
    assert target.read_bytes() == b"new"


def test_a_bare_key_error_keeps_its_type_name(capsys):
    def missing(args):
        raise KeyError("rank3")

    assert _cli(missing)(["run"]) == 1
    assert capsys.readouterr().err.strip() == "demo-cli: error: KeyError: 'rank3'"


def test_integer_and_number_bounds(capsys):
    port = console.integer("--port", 0, 65535)
    assert port("0") == 0 and port("65535") == 65535
    for bad in ("-1", "65536", "1.5", "x"):
        with pytest.raises(Exception, match="--port must be an integer >= 0 and <= 65535"):
            port(bad)
    ttft = console.number("--ttft", 0.0, 60.0)
    assert ttft("0") == 0.0
    with pytest.raises(Exception, match="--ttft must be a number >= 0 and <= 60"):
        ttft("nan")


def test_testing_helper_checks_code_message_traceback_and_files(tmp_path):
    from hwtopo import testing

    def tidy(argv):
        print("tidy: error: --out is bad", file=__import__("sys").stderr)
        return 2

    def messy(argv):
        (tmp_path / "made").mkdir()
        raise SystemExit(2)

    testing.assert_fails(tidy, "run --out {tmp}/x", 2, "--out is bad", tmp=tmp_path, prog="tidy")
    with pytest.raises(AssertionError, match="changed"):
        testing.assert_fails(messy, ["run"], 2, "", tmp=tmp_path)
    with pytest.raises(AssertionError, match="exit 2, wanted 1"):
        testing.assert_fails(tidy, "run", 1, "--out")


def test_atomic_dir_replaces_whole_or_keeps_the_old(tmp_path):
    import hwtopo

    target = tmp_path / "ckpt"
    hwtopo.atomic_dir(target, lambda d: (d / "a").write_text("1"))
    with pytest.raises(RuntimeError):
        hwtopo.atomic_dir(target, lambda d: [(d / "b").write_text("2"), (_ for _ in ()).throw(RuntimeError("x"))])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and (target / "a").read_text() == "1"
    hwtopo.atomic_dir(target, lambda d: (d / "b").write_text("2"))
    assert sorted(p.name for p in target.iterdir()) == ["b"]


def test_the_shared_demo_root_is_created_in_a_fresh_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert console.output_dir("demo-output/kvpool", "--out").is_dir()
    with pytest.raises(console.UsageError, match="its parent"):
        console.output_dir("elsewhere/kvpool", "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-output"]


def test_huge_integers_and_sizes_are_usage_errors_with_whole_bounds():
    seed = console.integer("--seed", 0, 2**32 - 1)
    with pytest.raises(Exception, match=r"--seed must be an integer >= 0 and <= 4294967295, not '1000"):
        seed("1" + "0" * 400)
    mem = console.size("--memory")
    assert mem("256MiB") == 256 << 20
    for bad in ("0", "1e400GiB", "nan", "-1GiB", "lots", "2PiB"):
        with pytest.raises(Exception, match="--memory must be a size from 1 B to"):
            mem(bad)


def test_output_dir_tolerates_a_peer_creating_it_at_the_same_moment(tmp_path, monkeypatch):
    """Every rank of a torchrun launch checks the same --out: the one that loses the race still passes."""
    target = tmp_path / "ckpt"
    real_exists = type(target).exists
    monkeypatch.setattr(type(target), "exists", lambda self: False if self == target else real_exists(self))
    target.mkdir()  # the peer won
    assert console.output_dir(target, "--ckpt-dir") == target


def test_bench_doc_keys_in_order_and_write_json(tmp_path):
    import json

    doc = console.bench_doc("pkg", "1.0", {"seed": 1}, {"a": {"t": 1.5}}, {"speedup": 2.0}, emulated=False)
    assert list(doc) == ["package", "version", "config", "machine", "results", "headline", "emulated"]
    assert doc["machine"]["machines"] and doc["headline"] == {"speedup": 2.0}
    console.write_json(tmp_path / "b.json", {**doc, "where": tmp_path})
    text = (tmp_path / "b.json").read_text()
    assert text.endswith("}\n") and json.loads(text)["where"] == str(tmp_path)
    with pytest.raises(ValueError):
        console.write_json(tmp_path / "c.json", {"x": float("nan")}, allow_nan=False)
    assert not (tmp_path / "c.json").exists()


def test_save_figure_writes_whole_and_closes(tmp_path):
    plt = console.pyplot("hwtopo")
    if plt is None:
        pytest.skip("matplotlib is not installed")
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    assert console.save_figure(fig, tmp_path / "p.png", dpi=50) == tmp_path / "p.png"
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.fignum_exists(fig.number)
    fig, _ = plt.subplots()
    with pytest.raises(ValueError):
        console.save_figure(fig, tmp_path / "p.nosuchformat")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png"] and not plt.fignum_exists(fig.number)


def test_atomic_writes_get_the_modes_plain_writes_get(tmp_path):
    # a plot, a JSON or a saved model others may read: not the temp file's private 0600 / 0700
    import stat

    import hwtopo

    (tmp_path / "plain").write_text("x")
    (tmp_path / "plain-dir").mkdir()
    hwtopo.atomic_write_text(tmp_path / "atomic", "x")
    hwtopo.atomic_dir(tmp_path / "atomic-dir", lambda d: (d / "a").write_text("1"))

    def mode(name):
        return stat.S_IMODE((tmp_path / name).stat().st_mode)

    assert mode("atomic") == mode("plain") and mode("atomic-dir") == mode("plain-dir")
    old = os.umask(0o077)
    try:
        hwtopo.atomic_write_text(tmp_path / "private", "x")
    finally:
        os.umask(old)
    assert mode("private") == 0o600
