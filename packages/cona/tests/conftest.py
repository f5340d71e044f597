import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process tests (still run in nox -s tests)")
