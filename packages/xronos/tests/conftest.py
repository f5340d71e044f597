import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def train_runs(tmp_path_factory):
    """One 2-rank run (rank 1 emulated at half speed) shared by the training and resharding tests."""
    from dist_helpers import train_checks

    from xronos.launch import spawn

    return spawn(train_checks, 2, (str(tmp_path_factory.mktemp("ckpt")),), speeds=[1.0, 0.5], timeout_s=500)
