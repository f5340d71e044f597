import dataclasses

import pytest
import torch
from torch import nn

from sysprdict.layers import classify, decompose
from sysprdict.zoo import Shape, ZooModel, build


@dataclasses.dataclass
class _Custom(ZooModel):
    inputs: dict = dataclasses.field(default_factory=dict)

    def make_batch(self, shape, dtype=torch.float32, seed=0):
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.inputs.items()}

    def stages(self, batch):
        return [("model", lambda: self.module(**batch))]


def _wrap(module, **inputs):
    return _Custom("custom", "custom", "s", "text", module, 0, inputs=inputs)


class _Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 32)

    def forward(self, x):
        return self.proj(x)


def _rec(d, name):
    return next(r for r in d.records if r.name == name)


def test_linear_flops_bytes_params_saved():
    x = torch.randn(2, 8, 64, requires_grad=True)
    d = decompose(_wrap(_Lin(), x=x), Shape(2, 8))
    r = _rec(d, "proj")
    n = 2 * 8
    assert r.kind == "linear"
    assert r.params == 64 * 32 + 32
    assert r.fwd_flops == 2 * n * 64 * 32 + 0 * n  # addmm: 2*m*k*n
    assert r.bwd_flops == 2 * r.fwd_flops
    # addmm reads bias, input, weight and writes the output (views move nothing)
    assert r.fwd_bytes == 4 * (32 + n * 64 + 64 * 32 + n * 32)
    assert r.saved_bytes == {"float32": 4 * n * 64}  # the input is saved for the weight gradient


class _Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)

    def forward(self, x):
        return self.conv(x)


def test_conv_flops():
    x = torch.randn(2, 3, 16, 16)
    d = decompose(_wrap(_Conv(), x=x), Shape(2, 1))
    r = _rec(d, "conv")
    assert r.kind == "conv"
    assert r.params == 8 * 3 * 9
    assert r.fwd_flops == 2 * (2 * 8 * 16 * 16) * 3 * 9
    assert r.fwd_bytes == 4 * (2 * 3 * 16 * 16 + 8 * 3 * 9 + 2 * 8 * 16 * 16)


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, q, k, v):
        return nn.functional.scaled_dot_product_attention(q * self.scale, k, v)


class MyAttention(_Attn):
    pass


def test_attention_flops_and_kind():
    b, h, s, dh = 2, 4, 16, 8
    q, k, v = (torch.randn(b, h, s, dh, requires_grad=True) for _ in range(3))
    d = decompose(_wrap(MyAttention(), q=q, k=k, v=v), Shape(2, 16))
    r = _rec(d, "<root>")
    assert r.kind == "attention"
    mul = b * h * s * dh  # q * scale: one FLOP per output element
    assert r.fwd_flops == 4 * b * h * s * s * dh + mul
    assert r.bwd_flops == 2 * 4 * b * h * s * s * dh + mul


def test_unknown_kinds_counted_by_name(caplog):
    class Zorblax(nn.Module):
        def forward(self, x):
            return x * 2

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Zorblax()
            self.b = Zorblax()

        def forward(self, x):
            return self.b(self.a(x))

    d = decompose(_wrap(Outer(), x=torch.randn(4, 4)), Shape(1, 1))
    assert d.unknown == {"Zorblax": 2}
    assert "Zorblax" in caplog.text


def test_classify_real_transformers_modules():
    assert classify("LlamaRMSNorm") == "norm"
    assert classify("LlamaAttention") == "attention"
    assert classify("Conv1D") == "linear"
    assert classify("LlamaDecoderLayer") == "container"
    assert classify("Zorblax") == "unknown"


@pytest.mark.parametrize("name", ["llama-xs", "gpt2-xs", "siglip-vit-xs", "llava-clip-xs"])
def test_real_models_decompose_with_exact_params(name):
    zm = build(name)
    d = decompose(zm, Shape(2, 16))
    assert d.params == zm.num_params()  # tied and unused weights included once
    assert not d.unknown
    assert d.saved_bytes > 0 and d.fwd_flops > 0


def test_precision_changes_saved_dtypes_and_batch_scales_linearly():
    zm = build("llava-siglip-xs")
    fp32 = decompose(zm, Shape(1, 16), "fp32")
    mixed = decompose(zm, Shape(1, 16), "mixed")
    assert "bfloat16" in mixed.saved_by_dtype() and "bfloat16" not in fp32.saved_by_dtype()
    two = decompose(zm, Shape(2, 16), "fp32")
    four = decompose(zm, Shape(4, 16), "fp32")
    # saved activations grow (almost exactly) linearly with the batch
    per_sample_small = two.saved_bytes - fp32.saved_bytes
    per_sample_large = (four.saved_bytes - two.saved_bytes) / 2
    assert abs(per_sample_large / per_sample_small - 1) < 0.02
    assert two.fwd_flops > fp32.fwd_flops


def test_decompose_does_not_touch_real_weights():
    zm = build("llama-xs")
    before = {k: v.clone() for k, v in zm.module.state_dict().items()}
    decompose(zm, Shape(2, 8), "bf16")
    after = zm.module.state_dict()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == before[k].dtype for k in before)
