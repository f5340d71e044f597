"""Dense matmuls costed at this machine's measured kernel speed per size and dtype."""

import math
import warnings

import pytest
import torch
from torch import nn

import sysprdict.timepred as tp
from sysprdict.layers import decompose
from sysprdict.timepred import TimePredictor, cpu_isa, mape, matmul_seconds
from sysprdict.zoo import Shape, ZooModel, build


class _Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, input_ids, labels=None):
        x = torch.ones(*input_ids.shape, 8)
        y = self.proj(x)
        return type("Out", (), {"loss": y.sum(), "logits": y})()


def test_matmul_shapes_are_recorded_per_dtype():
    zm = ZooModel("lin", "lin", "", "text", _Lin(), 0)
    d = decompose(zm, Shape(2, 3), "fp32")
    assert d.matmul_shapes == {"float32:1:6:8:4": 1}
    table = {"float32": [(0.0, math.log(1e-9)), (40.0, math.log(1e-9))]}
    assert matmul_seconds(d, table) == pytest.approx(2 * 6 * 8 * 4 * 1e-9)
    d16 = decompose(build("llama-xs"), Shape(1, 8), "fp16")
    assert d16.matmul_shapes and all(k.startswith("float16:") for k in d16.matmul_shapes)


def test_size_extrapolation_follows_the_measured_kernel_speed(monkeypatch):
    # synthetic truth: bf16 matmuls get 8x cheaper per FLOP as they grow (as AMX does), fp32 stay
    # flat; every dispatched (non-view) op costs 20 us. Trained on small sizes only, the calibrated predictor must
    # extrapolate to a larger size because the speed-up is in its measured table, not in the fit.
    table = {
        "float32": [(math.log(1e3), math.log(1e-10)), (math.log(1e9), math.log(1e-10))],
        "bfloat16": [(math.log(1e3), math.log(4e-10)), (math.log(1e9), math.log(5e-11))],
        "float16": [(math.log(1e3), math.log(1e-9)), (math.log(1e9), math.log(1e-9))],
    }
    monkeypatch.setattr(tp, "MATMUL_SECONDS", table)
    monkeypatch.setattr(tp, "EXPERTS_MATMUL_COST", {"float32": 1.0, "bfloat16": 1.0, "float16": 1.0})

    def truth(d):
        return matmul_seconds(d, table) + 2e-5 * sum(v for k, v in d.op_mix.items() if "_count:" in k)

    train = [
        decompose(build(f"{f}-{s}"), Shape(2, 16), p)
        for f in ("llama", "gpt2")
        for s in ("xs", "s")
        for p in ("fp32", "bf16")
    ]
    test = [decompose(build(f"{f}-xl"), Shape(4, 128), p) for f in ("llama", "gpt2") for p in ("fp32", "bf16")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = TimePredictor(kind="calibrated").fit(train, [truth(d) for d in train])
        err = mape(model.predict(test), [truth(d) for d in test])
    assert err < 0.05
    assert model.isa == cpu_isa()


def test_cpu_isa_is_what_hwtopo_probes_from_cpuinfo():
    from hwtopo.model import ISA_FLAGS

    flags: set[str] = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    assert cpu_isa() == [f for f in ISA_FLAGS if f in flags]
