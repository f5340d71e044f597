import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def dlm():
    """A tiny random bidirectional model (mechanics only; never the trained one)."""
    from bicache.model import DiffusionLM

    return DiffusionLM.random(seed=0, layers=4, hidden=32, heads=2)


@pytest.fixture(scope="session")
def task(dlm):
    from bicache.task import TableTask

    return TableTask(dlm.spec, seed=7)
