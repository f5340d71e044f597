"""Shared settings for the integration scenarios: one thread per process, like every package's tests."""

import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
