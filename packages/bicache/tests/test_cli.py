import subprocess
import sys

from bicache.cli import main


def test_usage_errors_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("BICACHE_TOKEN", raising=False)
    assert main(["serve", "--port", "0"]) == 2
    assert "--port" in capsys.readouterr().err
    assert main(["serve", "--host", "0.0.0.0"]) == 2  # beyond loopback, no token
    assert "--token" in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "bicache", "bench", "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr


def test_runtime_error_is_one_line_exit_1(tmp_path, capsys):
    code = main(["calibrate", "--checkpoint", str(tmp_path / "missing"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "holds no bicache checkpoint" in err and "Traceback" not in err
