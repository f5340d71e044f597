"""hwtopo.testing: the helpers the packages' tests share must themselves catch what they claim to."""

import pickle

import pytest
import torch

from hwtopo import console
from hwtopo.testing import Payload, assert_plot_skipped, assert_version, scratch_tree


def test_payload_runs_its_command_when_unpickled_and_not_under_weights_only(tmp_path):
    marker = tmp_path / "it ran"  # a space: the command quotes the path
    torch.save({"model": Payload(marker)}, tmp_path / "x.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "x.pt", weights_only=True)
    assert not marker.exists()
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


def test_scratch_tree_holds_the_usual_paths_and_the_extra_files(tmp_path):
    root = scratch_tree(tmp_path, {"garbage.json": b"\xff", "broken/config.json": "{not json"})
    assert root == tmp_path and (root / "dir").is_dir() and (root / "file").read_text() == "x"
    assert (root / "garbage.json").read_bytes() == b"\xff"
    assert (root / "broken" / "config.json").read_text() == "{not json"


def test_assert_version_checks_exit_and_line():
    def main(argv):
        print("tool 1.2.3")
        return 0

    assert assert_version(main, "tool") == "tool 1.2.3"
    assert_version(main, "tool", "1.2.3")
    with pytest.raises(AssertionError, match="wanted tool 1.2.4"):
        assert_version(main, "tool", "1.2.4")
    with pytest.raises(AssertionError, match="wanted other <version>"):
        assert_version(main, "other")
    with pytest.raises(AssertionError, match="exit 2"):
        assert_version(lambda argv: 2, "tool")


def test_a_plot_without_matplotlib_is_skipped_with_the_install_hint(monkeypatch, tmp_path, caplog):
    def plot(path):
        plt = console.pyplot("demo")
        if plt is None:
            return False
        path.write_text("a plot")
        return True

    assert_plot_skipped(plot, tmp_path / "p.png", "demo", monkeypatch, caplog)
    with pytest.raises(AssertionError, match="mlsyskit-other"):
        assert_plot_skipped(plot, tmp_path / "p.png", "other", monkeypatch, caplog)
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="matplotlib"):
        assert_plot_skipped(lambda p: p.write_text("x") and False, tmp_path / "q.png", "demo", monkeypatch, caplog)
