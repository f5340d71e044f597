import pytest
import torch
from conftest import tiny_model
from torch import nn

from parser_moe import NoMoEError, find_moe_layers

FAMILIES = ["qwen2_moe", "qwen3_moe", "olmoe", "mixtral", "deepseek_v2", "deepseek_v3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_detects_fused_experts_and_canonical_weights_match(family):
    model = tiny_model(family)
    layers = find_moe_layers(model)
    assert len(layers) == 2
    assert all("shared" not in ly.name for ly in layers)
    ly = layers[0]
    assert ly.layout == "fused" and ly.num_experts == 4 and ly.hidden == 32
    w = ly.weights()
    assert w.gate.shape == (4, ly.intermediate, 32) and w.down.shape == (4, 32, ly.intermediate)
    # routing every token to expert 2 with weight 1 must equal the canonical expert 2 forward
    x = torch.randn(5, 32)
    idx = torch.full((5, 1), 2)
    with torch.no_grad():
        y = ly.module(x, idx, torch.ones(5, 1))
    torch.testing.assert_close(y, w.expert_forward(2, x, ly.act_fn), rtol=1e-5, atol=1e-5)


def test_shared_experts_are_left_out():
    model = tiny_model("qwen2_moe")
    names = [ly.name for ly in find_moe_layers(model)]
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_model_without_moe_layers_is_a_clear_error():
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=24)
    with pytest.raises(NoMoEError, match="has no MoE layers"):
        find_moe_layers(T.AutoModelForCausalLM.from_config(cfg))


class _Expert(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.w1, self.w3, self.w2 = (
            nn.Linear(h, i, bias=False),
            nn.Linear(h, i, bias=False),
            nn.Linear(i, h, bias=False),
        )
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class PerExpertMoE(nn.Module):
    """Old Mixtral-style block: a ModuleList of experts, routing done by the block."""

    def __init__(self, h=16, i=8, e=4, k=2):
        super().__init__()
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(_Expert(h, i) for _ in range(e))
        self.k = k

    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        w, idx = probs.topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out


class PerExpertModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(PerExpertMoE() for _ in range(2))

    def forward(self, input_ids=None, x=None):
        x = x if x is not None else torch.nn.functional.one_hot(input_ids % 16, 16).float().reshape(-1, 16)
        for b in self.blocks:
            x = x + b(x)
        return x


def test_detects_per_expert_layout():
    torch.manual_seed(0)
    model = PerExpertModel()
    layers = find_moe_layers(model)
    assert [ly.layout for ly in layers] == ["per_expert", "per_expert"]
    ly = layers[0]
    assert (ly.num_experts, ly.hidden, ly.intermediate) == (4, 16, 8)
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(ly.module[1](x), ly.weights().expert_forward(1, x, ly.act_fn))


class TransposedInterleavedExperts(nn.Module):
    """A fused layout stored transposed with gate/up interleaved (as transformers flags it for GPT-OSS)."""

    is_transposed = True
    is_concatenated = False

    def __init__(self, e=4, h=12, i=6):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(e, h, 2 * i))
        self.down_proj = nn.Parameter(torch.randn(e, i, h))
        self.act_fn = nn.SiLU()

    def forward(self, x, idx, w):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for s in range(idx.shape[1]):
                e = int(idx[t, s])
                gu = x[t] @ self.gate_up_proj[e]
                out[t] += w[t, s] * (self.act_fn(gu[0::2]) * gu[1::2]) @ self.down_proj[e]
        return out


class TransposedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(12, 4, bias=False)
        self.experts = TransposedInterleavedExperts()

    def forward(self, input_ids=None):
        x = torch.nn.functional.one_hot(input_ids.reshape(-1) % 12, 12).float() + 0.1
        w, idx = self.router(x).softmax(-1).topk(2, dim=-1)
        return self.experts(x, idx, w)


def test_transposed_interleaved_fused_layout_is_read_from_its_flags():
    from parser_moe import calibrate, compress_model, prepare

    torch.manual_seed(0)
    model = TransposedModel()
    (ly,) = find_moe_layers(model)
    assert ly.transposed and not ly.concatenated and (ly.hidden, ly.intermediate) == (12, 6)
    x = torch.randn(3, 12)
    with torch.no_grad():
        y = ly.module(x, torch.full((3, 1), 1), torch.ones(3, 1))
    torch.testing.assert_close(y, ly.weights().expert_forward(1, x, ly.act_fn), rtol=1e-5, atol=1e-5)
    ids = torch.arange(240)[None]
    plan = prepare(model, calibrate(model, ids), "aligned")
    with torch.no_grad():
        torch.testing.assert_close(
            compress_model(model, plan, "parser", 1.0)(input_ids=ids), model(input_ids=ids), rtol=1e-4, atol=1e-4
        )
