"""Leave-architecture-out split and the runtime-overhead (real peak) model."""

import json

import pytest

from sysprdict.layers import decompose
from sysprdict.memory import TrainSetup, predict_memory, with_overhead
from sysprdict.names import FAMILIES, HELDOUT_FAMILIES
from sysprdict.overhead import RuntimeOverhead, fit_overhead
from sysprdict.split import family_components, strict_split
from sysprdict.zoo import Shape, build

MiB = 1 << 20


def test_strict_split_shares_no_component():
    train, excluded = strict_split()
    held = set().union(*(family_components(f) for f in HELDOUT_FAMILIES))
    assert train and not set(train) & set(HELDOUT_FAMILIES)
    for f in train:
        assert not family_components(f) & held, f
    # the LLaVA-shaped families share the held-out LLaVA's projector and wrapper: left out, and why
    assert set(excluded) == {"llava-clip", "llava-siglip"}
    assert any("LlavaMultiModalProjector" in c for c in excluded["llava-clip"])
    assert set(train) | set(excluded) == set(FAMILIES)
    # every held-out architecture has components of its own (decoder, vision tower, projector)
    assert any("GPTNeoXLayer" in c for c in family_components("gpt-neox"))
    assert any("Dinov2" in c for c in family_components("llava-dinov2-phi"))
    assert any("PhiDecoderLayer" in c for c in family_components("llava-dinov2-phi"))


def _decomps():
    out = []
    for name, prec in [("llama-xs", "fp32"), ("gpt2-s", "fp32"), ("vit-s", "bf16"), ("llama-s", "bf16")]:
        for b in (1, 4):
            out.append(decompose(build(name), Shape(b, 16), prec))
    for b in (1, 3):
        out.append(decompose(build("qwen2-s"), Shape(b, 16), "fp16"))
    # more models than runtime terms in every precision group, so the per-kernel and
    # per-layer terms are told apart from each group's baseline
    for name, prec in [("gpt2-xs", "fp32"), ("qwen2-xs", "bf16"), ("vit-xs", "fp16"), ("clip-vit-s", "fp32")]:
        out.append(decompose(build(name), Shape(2, 16), prec))
    return out


def test_overhead_fit_recovers_known_runtime_terms(tmp_path):
    ds = _decomps()
    tensors = [predict_memory(d, TrainSetup()).peak_bytes for d in ds]
    base = {"fp32": 20 * MiB, "bf16": 35 * MiB, "fp16": 38 * MiB}

    def runtime(d):  # per distinct kernel shape and per parameterised layer
        return 0.4 * MiB * len(d.kernel_calls) + 0.1 * MiB * sum(1 for r in d.records if r.params)

    real = [base[d.precision] + 1.3 * t + runtime(d) for d, t in zip(ds, tensors)]
    real[0] *= 3  # one odd configuration must not set the terms for all
    ov = fit_overhead(ds, tensors, real)
    assert ov.per_kernel == pytest.approx(0.4 * MiB, rel=0.05)
    assert ov.per_param_layer == pytest.approx(0.1 * MiB, rel=0.05)
    assert ov.allocator == "cpu"
    assert fit_overhead(ds, tensors, real, allocator="cuda").allocator == "cuda"
    with pytest.raises(ValueError, match="allocator"):
        fit_overhead(ds, tensors, real, allocator="tpu")
    assert ov.tensor_factor == pytest.approx(1.3, rel=0.02)
    assert ov.baseline["fp32"] == pytest.approx(20 * MiB, rel=0.02)
    assert ov.baseline["autocast"] == pytest.approx(38 * MiB, rel=0.02)
    assert ov.margin == pytest.approx(2.0, rel=0.05)  # the odd one is under-predicted 3x: kept as margin
    d = ds[3]
    pred = with_overhead(predict_memory(d, TrainSetup()), d, ov)
    assert pred.tensor_peak_bytes == tensors[3]
    assert pred.peak_bytes == pytest.approx(real[3], rel=0.02)
    assert set(pred.runtime) >= {"tensors", "framework_baseline", "allocator", "total"}
    path = tmp_path / "overhead.json"
    ov.save(path)
    assert RuntimeOverhead.load(path) == ov
    stale = json.loads(path.read_text())
    stale["software"]["torch"] = "0.0"
    path.write_text(json.dumps(stale))
    with pytest.raises(ValueError, match="torch"):
        RuntimeOverhead.load(path)
    path.write_text("{}")
    with pytest.raises(ValueError, match="overhead"):
        RuntimeOverhead.load(path)
    with pytest.raises(ValueError, match="equally many"):
        fit_overhead(ds, tensors[:2], real)


def test_bench_plan_holds_out_architectures_and_sizes():
    from sysprdict.evaluate import harness_plan
    from sysprdict.names import SIZES

    plan = harness_plan(quick=True)
    roles = {c["role"] for c in plan}
    assert roles == {"train", "extrap", "heldout"}
    train_fams = {c["model"].rsplit("-", 1)[0] for c in plan if c["role"] != "heldout"}
    assert not train_fams & set(HELDOUT_FAMILIES)
    assert {c["model"].rsplit("-", 1)[0] for c in plan if c["role"] == "heldout"} == set(HELDOUT_FAMILIES)
    # size extrapolation: every test size exceeds every training size in width, batch and tokens
    train = [c for c in plan if c["role"] == "train"]
    for c in (c for c in plan if c["role"] == "extrap"):
        width = SIZES[c["model"].rsplit("-", 1)[1]][0]
        assert width >= 256 and c["seq_len"] >= 128 and c["batch"] >= 4
        assert all(width > SIZES[t["model"].rsplit("-", 1)[1]][0] for t in train)
        assert all(c["batch"] > t["batch"] and c["seq_len"] > t["seq_len"] for t in train)
    # the held-out architectures at two sizes, the larger included
    sizes = {c["model"].rsplit("-", 1)[1] for c in plan if c["role"] == "heldout"}
    assert sizes == {"m", "xl"}
    # every precision is trained with both optimizers (else their costs are confounded)
    for p in {c["precision"] for c in train}:
        assert {c["optimizer"] for c in train if c["precision"] == p} == {"sgd", "adamw"}
