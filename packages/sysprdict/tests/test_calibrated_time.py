"""Dense matmuls costed at this machine's measured kernel speed per size and dtype."""

import json
import math
import warnings

import pytest
import torch
from torch import nn

import sysprdict.timepred as tp
from sysprdict import kernels
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


def test_heavy_ops_are_recorded_as_replayable_kernel_specs():
    zm = ZooModel("lin", "lin", "", "text", _Lin(), 0)
    d = decompose(zm, Shape(2, 3), "fp32")
    [(spec, n)] = d.kernel_calls.items()
    info = kernels.spec_info(spec)
    assert (n, info["op"], info["dtype"], info["mm"], info["flops"]) == (
        1,
        "addmm",
        "float32",
        "1:6:8:4",
        2 * 6 * 8 * 4,
    )
    # the activations were made inside forward (no gradient); the weight needs one
    assert [a["grad"] for a in info["args"] if isinstance(a, dict)] == [True, False, True]
    assert 0 < kernels.kernel_seconds(spec) < 1
    dv = decompose(build("vit-xs"), Shape(1, 8, 32), "fp16")
    ops = {kernels.spec_info(s)["op"] for s in dv.kernel_calls}
    assert {"convolution", "_scaled_dot_product_flash_attention_for_cpu"} <= ops
    for s in dv.kernel_calls:
        assert kernels.kernel_seconds(s) > 0  # every recorded spec replays, forward and backward


def test_kernels_too_large_to_replay_use_the_size_table(monkeypatch):
    d = decompose(build("llama-xs"), Shape(1, 8), "fp32")
    table = {"float32": [(0.0, math.log(2e-9)), (40.0, math.log(2e-9))]}
    monkeypatch.setattr(kernels, "kernel_seconds", lambda spec: pytest.fail("replayed a spec over the limit"))
    for limit in ("REPLAY_MAX_BYTES", "REPLAY_MAX_FLOPS"):
        with monkeypatch.context() as m:
            m.setattr(kernels, limit, 0)
            terms = tp.calibrated_terms(d, "adamw", {}, table)
        assert terms["mm_calibrated_s"] == pytest.approx(matmul_seconds(d, table))
        assert terms["mm_flops:float32"] == 0  # every dense matmul FLOP is costed by the table, not the fit


def test_time_kernels_keeps_each_kernels_quietest_pass(monkeypatch):
    d = decompose(build("llama-xs"), Shape(1, 8), "fp32")
    specs = list(d.kernel_calls)
    big = json.dumps({**kernels.spec_info(specs[0]), "flops": 10**15}, sort_keys=True)
    n = len(set(specs))
    seen = iter([v for v in (3.0, 1.0, 2.0) for _ in range(n)])  # pass p times every spec at the p-th value
    monkeypatch.setattr(tp, "_best_cpu_s", lambda fn: next(seen))
    monkeypatch.setattr(kernels, "KERNEL_SECONDS", {})
    assert kernels.time_kernels([*specs, big, specs[0]], passes=3) == len(set(specs))
    assert big not in kernels.KERNEL_SECONDS  # over the FLOPs limit: never replayed
    assert set(kernels.KERNEL_SECONDS.values()) == {1.0}  # passes gave 3, 1, 2: the minimum is kept


def _synthetic_kernel_seconds(spec: str) -> float:
    # bf16 kernels get 8x cheaper per FLOP as they grow (as AMX does), fp32 stay flat, fp16 slow
    info = kernels.spec_info(spec)
    per_flop = {"float32": 1e-10, "float16": 1e-9}.get(info["dtype"])
    if per_flop is None:
        x = min(max((math.log(max(info["flops"], 1)) - math.log(1e3)) / math.log(1e6), 0.0), 1.0)
        per_flop = math.exp((1 - x) * math.log(4e-10) + x * math.log(5e-11))
    return info["flops"] * per_flop


@pytest.mark.parametrize("in_step", [1.0, 1.3])
def test_size_extrapolation_follows_the_measured_kernel_speed(monkeypatch, in_step):
    # synthetic truth: the heavy kernels cost `in_step` x what the (synthetic) replay measures,
    # every dispatched op 20 us more and every byte the other ops move 0.1 ns (the synthetic
    # elementwise calibration). Trained on small sizes only, the calibrated predictor must
    # extrapolate to a larger size because the kernels' speed-up is measured at the larger shapes,
    # and only their one in-step factor is fitted.
    monkeypatch.setattr(kernels, "kernel_seconds", _synthetic_kernel_seconds)
    monkeypatch.setattr(tp, "EXPERTS_MATMUL_COST", {"float32": 1.0, "bfloat16": 1.0, "float16": 1.0})
    monkeypatch.setattr(tp, "ELEMENTWISE_COST", {"float32": (2e-5, 1e-10), "bfloat16": (2e-5, 1e-10)})

    def truth(d):
        heavy = sum(n * _synthetic_kernel_seconds(s) for s, n in d.kernel_calls.items())
        t = tp.opmix_terms(d)
        return in_step * heavy + 2e-5 * t["ops"] + 1e-10 * sum(v for k, v in t.items() if k.startswith("other_bytes"))

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
    assert model.kernel_in_step_factor == pytest.approx(in_step, rel=0.05)
    assert model.isa == cpu_isa()


def test_cpu_isa_is_what_hwtopo_probes_from_cpuinfo():
    from hwtopo.model import ISA_FLAGS

    flags: set[str] = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    assert cpu_isa() == [f for f in ISA_FLAGS if f in flags]


def test_elementwise_calibration_has_a_per_op_and_per_byte_cost_per_dtype(monkeypatch):
    monkeypatch.setattr(tp, "ELEMENTWISE_COST", {})
    res = tp.calibrate_elementwise()
    assert set(res) == {"float32", "bfloat16", "float16"} and tp.ELEMENTWISE_COST == res
    assert all(per_op > 0 and per_byte >= 0 for per_op, per_byte in res.values())
    d = decompose(build("llama-xs"), Shape(1, 8), "fp32")
    t = tp.calibrated_terms(d, "adamw", {}, {"float32": [(0.0, -20.0)]})
    assert t["elementwise_s"] == pytest.approx(
        t["ops"] * res["float32"][0] + t["other_bytes:float32"] * res["float32"][1]
    )
