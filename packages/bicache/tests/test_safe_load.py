"""The training state bicache resumes from loads without unpickling anything but tensors and plain values."""

import logging

import pytest
import torch

from bicache.train import Recipe, load_train_state, train
from hwtopo.testing import Payload

TINY = dict(layers=1, local_layers=0, hidden=16, heads=2, batch=4, eval_every=1, val_requests=8, target=2.0)


def test_resume_reads_the_state_it_wrote_and_continues_exactly(tmp_path, caplog):
    train(Recipe(steps=4, **TINY), progress=False, resume_dir=tmp_path / "full")
    train(Recipe(steps=2, **TINY), progress=False, resume_dir=tmp_path / "split")
    with caplog.at_level(logging.INFO, logger="bicache.train"):
        train(Recipe(steps=4, **TINY), progress=False, resume_dir=tmp_path / "split")
    assert "resuming training at step 2" in caplog.text
    full = load_train_state(tmp_path / "full" / "train-state.pt")
    split = load_train_state(tmp_path / "split" / "train-state.pt")
    assert full["step"] == split["step"] == 4
    assert full["rng"] == split["rng"] and torch.equal(full["gen"], split["gen"])
    for k, v in full["model"].items():
        assert torch.equal(split["model"][k], v), k


def test_a_crafted_train_state_never_runs_its_payload(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "train-state.pt"
    torch.save({"model": Payload(marker), "step": 3}, path)
    torch.load(path, weights_only=False)  # the payload is live: a plain unpickle runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(ValueError, match="train-state.pt holds objects other than tensors"):
        train(Recipe(steps=4, **TINY), progress=False, resume_dir=tmp_path)
    assert not marker.exists()


def test_a_model_directory_with_its_own_code_is_not_run_unasked(tmp_path):
    """A local DLM whose config points at Python files of its own: refused unless trusted."""
    from bicache.model import load_local_dlm

    marker = tmp_path / "ran"
    (tmp_path / "config.json").write_text(
        '{"model_type": "evil", "auto_map": {"AutoConfig": "evil.Cfg", "AutoModel": "evil.Model"}}'
    )
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    with pytest.raises(PermissionError, match="trust_remote_code=True"):
        load_local_dlm(tmp_path)
    assert not marker.exists()


def test_a_binary_task_json_names_the_file(tmp_path):
    from bicache.model import DiffusionLM

    (tmp_path / "task.json").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="task.json: not a bicache task spec"):
        DiffusionLM.load(tmp_path)
