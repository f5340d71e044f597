"""Device selection per rank (NCCL: the GPU numbered LOCAL_RANK), checked on the CPU."""

import os

import pytest
import torch

from cona.dist import launch, select_device
from cona.executor import Executor, initial_state
from cona.model import tiny_llama_config
from cona.space import Strategy


def test_gloo_runs_on_the_cpu_whatever_local_rank_says():
    assert select_device("gloo", env={"LOCAL_RANK": "3"}, cuda_count=8) == torch.device("cpu")


def test_nccl_takes_the_gpu_named_by_local_rank():
    assert select_device("nccl", env={"LOCAL_RANK": "3"}, cuda_count=4) == torch.device("cuda", 3)
    assert select_device("nccl", env={"LOCAL_RANK": "0"}, cuda_count=1, rank=5) == torch.device("cuda", 0)


def test_nccl_without_local_rank_uses_the_rank_modulo_the_gpus():
    assert select_device("nccl", env={}, cuda_count=4, rank=6) == torch.device("cuda", 2)


@pytest.mark.parametrize("raw", ["4", "-1", "gpu1"])
def test_bad_local_rank_is_a_clear_error(raw):
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        select_device("nccl", env={"LOCAL_RANK": raw}, cuda_count=4)


def test_nccl_without_gpus_says_so():
    with pytest.raises(RuntimeError, match="CUDA device"):
        select_device("nccl", env={"LOCAL_RANK": "0"}, cuda_count=0)


def _worker(rank, world):
    cfg = tiny_llama_config(2, 32, 4, 2, 96)
    ex = Executor(Strategy(2, 1, 1, 4, 8), cfg, initial_state(cfg, 0))
    return {
        "local_rank": os.environ.get("LOCAL_RANK"),
        "device": str(ex.device),
        "param_devices": sorted({str(p.device) for p in ex.params.values()}),
        "state_device": sorted({str(t.device) for t in ex.full_state().tensors["param"].values()}),
    }


@pytest.mark.slow
def test_launch_sets_local_rank_and_the_executor_uses_the_rank_device():
    out = launch(_worker, 2, timeout_s=120)
    assert [o["local_rank"] for o in out] == ["0", "1"]
    for o in out:  # gloo here: everything on the CPU, the layout-independent state too
        assert o["device"] == "cpu" and o["param_devices"] == ["cpu"] and o["state_device"] == ["cpu"]
