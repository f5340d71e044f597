import json

from xronos.cli import main


def test_partition_command_prints_uneven_and_even(capsys):
    assert main(["partition", "--speeds", "1.0,0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sum(out["xronos"]["mlp_columns"]) == 1024 and out["even"]["mlp_columns"] == [512, 512]
    assert out["xronos"]["mlp_columns"][0] > out["xronos"]["mlp_columns"][1]
    assert out["predicted_speedup_vs_even"] > 1.0


def test_partition_from_hwtopo_cluster(capsys):
    assert main(["partition", "--cluster", "edge-home", "--heads", "8", "--kv-heads", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["xronos"]["q_heads"]) >= 2


def test_usage_errors_exit_2_with_one_line(capsys):
    assert main(["partition", "--speeds", "1,abc"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("xronos: error: --speeds") and "\n" not in err
    assert main(["partition", "--speeds", "1,1,1,1,1"]) == 2
    assert "cannot be split across 5 ranks" in capsys.readouterr().err
    assert main(["partition", "--speeds", "1,1", "--memory", "1KiB,1KiB"]) == 2
    assert "rank 0 has 1024 bytes" in capsys.readouterr().err
    assert main(["bench", "--quick", "--cpu-share", "0"]) == 2
    assert "--cpu-share" in capsys.readouterr().err
    assert main(["bench", "--quick", "--cpu-share", "lots"]) == 2
    assert "--cpu-share" in capsys.readouterr().err
    assert main(["train", "--data", "/nonexistent/file.txt", "--steps", "1"]) == 2
    assert "--data" in capsys.readouterr().err
    assert main(["bench", "--quick", "--steps", "0", "--quiet"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["demo", "--steps", "0", "--quiet"]) == 2
    assert "--steps" in capsys.readouterr().err


def test_unexpected_error_is_one_line_exit_1(monkeypatch, capsys):
    import xronos.cli as cli

    def boom(args):
        raise KeyError("rank3")

    monkeypatch.setattr(cli, "cmd_partition", boom)
    assert cli.main(["partition"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "xronos: error: KeyError: 'rank3'"
