"""Per-step checkpoints with a commit marker: which step a run resumes from, and what it never loads."""

import json
import os

import pytest
import torch
from dist_helpers import small_cfg

from hwtopo.testing import Payload
from xronos.partition import PartitionError
from xronos.runner import (
    COMMIT_MARKER,
    _remove_steps,
    choose_resume_step,
    committed_steps,
    resume_step,
    saved_partition,
    step_dir,
)
from xronos.train import CheckpointError, TPTrainer, read_checkpoint


def _step(root, step, ranks, world=None, marker=True):
    d = step_dir(root, step)
    d.mkdir(parents=True)
    for r in ranks:
        (d / f"rank{r}.pt").write_bytes(b"x")
    if marker:
        (d / COMMIT_MARKER).write_text(json.dumps({"step": step, "world": world or len(ranks)}))
    return d


def test_choose_resume_step_takes_the_newest_step_every_rank_has():
    assert choose_resume_step({}, 2, set()) is None
    assert choose_resume_step({2: 2, 4: 2, 6: 2}, 2, {2, 4, 6}) == 6
    assert choose_resume_step({2: 2, 4: 2, 6: 2}, 2, {2, 4}) == 4  # a rank lost its file of step 6
    assert choose_resume_step({2: 2, 4: 2}, 2, set()) is None
    with pytest.raises(PartitionError, match="step-4 was written by 3 ranks, not 2"):
        choose_resume_step({2: 2, 4: 3}, 2, {2, 4})


def test_resume_step_ignores_incomplete_and_unmarked_steps(tmp_path):
    assert resume_step(tmp_path / "absent", 2) is None
    _step(tmp_path, 2, [0, 1])
    _step(tmp_path, 4, [0, 1])
    _step(tmp_path, 6, [0], world=2)  # committed, yet rank 1's file is gone
    _step(tmp_path, 8, [0, 1], marker=False)  # both wrote, the commit never happened
    _step(tmp_path, 10, [0])  # only rank 0 wrote
    bad = _step(tmp_path, 12, [0, 1])
    (bad / COMMIT_MARKER).write_text("{not json")
    (tmp_path / "step-x").mkdir()  # not a step directory
    (tmp_path / "step-14").write_text("a file, not a directory")
    assert committed_steps(tmp_path) == {2: 2, 4: 2, 6: 2, 10: 1}
    with pytest.raises(PartitionError, match="step-10 was written by 1 ranks, not 2"):
        resume_step(tmp_path, 2)
    _remove_steps(tmp_path, 0, [10])
    assert resume_step(tmp_path, 2) == 4


def test_a_marker_naming_another_step_is_ignored(tmp_path):
    d = _step(tmp_path, 4, [0, 1])
    (d / COMMIT_MARKER).write_text(json.dumps({"step": 6, "world": 2}))
    assert committed_steps(tmp_path) == {}


def test_each_rank_removes_its_own_files_and_the_last_one_the_directory(tmp_path):
    d = _step(tmp_path, 2, [0, 1])
    (d / "rank1.pt.tmp123").write_bytes(b"partial")
    (d / "rank10.pt").write_bytes(b"another rank's")
    _remove_steps(tmp_path, 1, [2])
    assert sorted(p.name for p in d.iterdir()) == [COMMIT_MARKER, "rank0.pt", "rank10.pt"]
    _remove_steps(tmp_path, 0, [2, 99])
    assert sorted(p.name for p in d.iterdir()) == ["rank10.pt"]  # never deletes what is not its own
    _remove_steps(tmp_path, 10, [2])
    assert not d.exists()


def _crafted_checkpoint(path, marker):
    cfg = small_cfg()
    torch.save(
        {"model": Payload(marker), "opt": {}, "step": 2, "partition": None, "config": cfg.to_dict()},
        path,
    )
    # the payload is live: a plain unpickle would have run it
    torch.load(path, weights_only=False)
    assert marker.exists()
    marker.unlink()


def test_a_crafted_checkpoint_never_runs_its_payload(tmp_path):
    d = tmp_path / "step-2"
    d.mkdir()
    marker = tmp_path / "pwned"
    _crafted_checkpoint(d / "rank0.pt", marker)
    with pytest.raises(CheckpointError, match="not written by xronos"):
        read_checkpoint(d / "rank0.pt")
    with pytest.raises(CheckpointError, match="rank0.pt holds objects other than tensors"):
        TPTrainer(small_cfg(), None).load(d)
    with pytest.raises(CheckpointError, match="does not unpickle"):
        saved_partition(d, 0, small_cfg().shape(), 1)
    assert not marker.exists()


def test_checkpoint_files_round_trip_without_pickle_and_junk_is_named(tmp_path):
    t = TPTrainer(small_cfg(), None)
    t.step()
    path = t.save(tmp_path)
    again = TPTrainer(small_cfg(), None)
    assert again.load(tmp_path) and again.step_idx == 1
    for k, v in t.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[k], v), k
    assert again.opt.state_dict()["param_groups"] == t.opt.state_dict()["param_groups"]
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cannot be read"):
        read_checkpoint(path)
    torch.save({"model": {}}, path)
    with pytest.raises(CheckpointError, match="not an xronos checkpoint: it has no opt, step, partition, config"):
        read_checkpoint(path)


@pytest.mark.slow
def test_resume_after_a_rank_dies_mid_checkpoint_uses_the_last_committed_step(tmp_path):
    from checkpoint_workers import train_with_fault

    from xronos.launch import spawn

    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    # rank 1 dies while checkpointing step 4, after rank 0 wrote its own file of step 4: the state
    # that made independently checkpointing ranks resume from different steps
    with pytest.raises(Exception):  # noqa: B017 - which rank the launcher blames is its own concern
        spawn(train_with_fault, 2, (ckpt, 6, 4, "kill"), timeout_s=300)
    assert (tmp_path / "ckpt" / "step-4" / "rank0.pt").is_file()
    assert resume_step(ckpt, 2) == 2
    # resumed from step 2, rank 1 cannot write step 4 (a full disk): every rank stops, naming it
    with pytest.raises(Exception, match=r"step 4 was not committed: rank\(s\) \[1\] could not write"):
        spawn(train_with_fault, 2, (ckpt, 6, 4, "enospc"), timeout_s=300)
    assert resume_step(ckpt, 2) == 2
    res = spawn(train_with_fault, 2, (ckpt, 6, None, None), timeout_s=300)
    ref = TPTrainer(small_cfg(steps=6), None)
    losses = [ref.step()["loss"] for _ in range(6)]
    for r in res:
        assert r["resumed_from"] == 2 and r["committed"] == 6
        assert r["losses"] == pytest.approx(losses[2:], rel=1e-5)
        assert r["eval_loss"] == pytest.approx(ref.evaluate(), rel=1e-5)
    # the two newest committed steps are kept, older and incomplete ones pruned
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-4", "step-6"]
    assert committed_steps(ckpt) == {4: 2, 6: 2}
