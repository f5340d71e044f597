import os

import pytest

from hwtopo import launch

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: slower end-to-end tests (still run in nox)")


@pytest.fixture
def free_port():
    return launch.free_port()
