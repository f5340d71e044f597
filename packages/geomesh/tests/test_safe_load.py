"""DiLoCo checkpoints load without unpickling anything but tensors and plain values."""

import os

import pytest
import torch
from _workers import batch, tiny_model

from geomesh import DiLoCo


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _worker(seed=0):
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, DiLoCo(model, opt, 2, compression="sign", chunk_size=16)


def test_checkpoint_round_trip_is_exact_without_pickle(tmp_path):
    model, opt, dl = _worker()
    for step in range(3):
        x, y = batch(0, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        dl.step(tokens=x.shape[0])
    dl.save(tmp_path / "w.pt", extra={"step": 3, "seen": [1.5, None, "a"], "t": torch.ones(2)})
    model2, _, dl2 = _worker(seed=1)
    extra = dl2.load(tmp_path / "w.pt")
    assert extra["step"] == 3 and extra["seen"] == [1.5, None, "a"] and torch.equal(extra["t"], torch.ones(2))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert (dl2.outer_step, dl2.local_step, dl2.tokens) == (dl.outer_step, dl.local_step, dl.tokens)
    assert torch.equal(dl2.compressor.residual, dl.compressor.residual)


def test_extra_that_would_need_pickle_is_refused_at_save(tmp_path):
    _, _, dl = _worker()
    with pytest.raises(TypeError, match=r"extra\['cfg'\]\[0\] is of type object"):
        dl.save(tmp_path / "w.pt", extra={"cfg": [object()]})
    assert not (tmp_path / "w.pt").exists()


def test_a_crafted_checkpoint_never_runs_its_payload(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "rank0.pt"
    _, _, dl = _worker()
    torch.save({"diloco": dl.state_dict(), "extra": {"step": _Payload(marker)}}, path)
    torch.load(path, weights_only=False)  # the payload is live: a plain unpickle runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(ValueError, match="rank0.pt holds objects other than tensors"):
        dl.load(path)
    assert not marker.exists()
    torch.save({"model": {}}, path)
    with pytest.raises(ValueError, match="was not written by DiLoCo.save"):
        dl.load(path)
