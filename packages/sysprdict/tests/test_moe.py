"""Mixture-of-experts: routed experts traced under an assumed routing, memory against MemTracker."""

import pytest
import torch
from torch import nn

from sysprdict.layers import assumed_routing, decompose
from sysprdict.memory import TrainSetup, predict_memory
from sysprdict.train import measure_training
from sysprdict.zoo import Shape, build


def test_moe_decomposition_has_experts_and_router_and_routing_invariant_activations():
    zm = build("qwen2-moe-xs")  # hidden 32, 4 experts of intermediate 32, top-2
    shape = Shape(2, 16)
    d = decompose(zm, shape, "fp32")
    assert not d.unknown
    experts = [r for r in d.records if r.kind == "experts"]
    assert len(experts) == 1 and any(r.kind == "router" for r in d.records)
    slots = shape.batch * shape.seq_len * 2  # tokens x top_k
    grouped = 2 * slots * 32 * 64 + 2 * slots * 32 * 32  # gate_up [S,32]x[E,32,64], down [S,32]x[E,32,32]
    assert grouped <= experts[0].fwd_flops < 1.2 * grouped
    # what the experts save for backward depends on tokens x top_k, not on how they are routed
    worst = decompose(zm, shape, "fp32", routing="worst")
    assert worst.saved_bytes == d.saved_bytes


def test_op_mix_records_the_dtype_each_op_ran_at():
    # fp16 autocast casts dense matmuls and attention to fp16; grouped expert matmuls are not on
    # autocast's list, so they run at the fp32 of their (norm-output) inputs
    d = decompose(build("qwen2-moe-xs"), Shape(2, 16), "fp16")
    mix = d.op_mix
    assert mix.get("experts_flops:float32", 0) > 0 and not mix.get("experts_flops:float16")
    assert mix.get("matmul_flops:float16", 0) > 0 and not mix.get("matmul_flops:float32")
    assert mix.get("sdpa_flops:float16", 0) > 0 and mix.get("cast_count:float16", 0) > 0
    assert sum(v for k, v in mix.items() if "_flops:" in k) == d.fwd_flops
    assert sum(v for k, v in mix.items() if "_bytes:" in k) == sum(r.fwd_bytes for r in d.records)
    pure = decompose(build("qwen2-moe-xs"), Shape(2, 16), "bf16").op_mix
    assert pure.get("experts_flops:bfloat16", 0) == mix["experts_flops:float32"]


def test_assumed_routing():
    bal = assumed_routing(torch.Size([6, 2]), torch.int64, 4, "balanced")
    assert torch.bincount(bal.flatten(), minlength=4).tolist() == [3, 3, 3, 3]
    assert all(len(set(row.tolist())) == 2 for row in bal)  # top-k experts of a token are distinct
    assert assumed_routing(torch.Size([6, 2]), torch.int64, 4, "worst").unique().tolist() == [0, 1]
    with pytest.raises(ValueError, match="routing"):
        assumed_routing(torch.Size([6, 2]), torch.int64, 4, "lucky")


@pytest.mark.parametrize("precision,optimizer,shape", [("fp32", "adamw", (2, 24)), ("bf16", "sgd", (4, 32))])
def test_moe_peak_within_5_percent_of_memtracker(precision, optimizer, shape):
    shape = Shape(*shape)
    measured = measure_training(build("qwen2-moe-s"), shape, precision, optimizer, steps=1, warmup=1)
    pred = predict_memory(decompose(build("qwen2-moe-s"), shape, precision), TrainSetup(optimizer))
    assert abs(pred.peak_bytes / measured.peak_bytes - 1) < 0.05, (pred.peak_event, measured.breakdown)


class LoopExperts(nn.Module):
    """A drop-in experts module whose dispatch is data dependent: it reads the routing's values
    (unique, nonzero), slices one packed weight by integer offsets held in a buffer, and keeps a
    frozen (buffer) base it shares across experts, as compressed experts do."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        e, two_i, h = experts.gate_up_proj.shape
        self.num_experts, self.inter, self.act_fn = e, two_i // 2, experts.act_fn
        self.packed = nn.Parameter(torch.randn(e * two_i, h) * 0.02)  # every expert's gate_up rows
        self.register_buffer("base", torch.randn(two_i, h) * 0.02)
        self.register_buffer("offsets", torch.arange(e + 1, dtype=torch.int64) * two_i)
        self.down = nn.Parameter(torch.randn(e, h, self.inter) * 0.02)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            tok, slot = (top_k_index == e).nonzero(as_tuple=True)
            a, b = int(self.offsets[e]), int(self.offsets[e + 1])
            gate, up = (hidden_states[tok] @ (self.packed[a:b] + self.base).T).chunk(2, dim=-1)
            y = (self.act_fn(gate) * up) @ self.down[e].T
            out.index_add_(0, tok, y * top_k_weights[tok, slot, None])
        return out


def test_data_dependent_experts_module_is_traced_and_predicted():
    zm = build("qwen2-moe-xs")
    for layer in zm.module.model.layers:
        layer.mlp.experts = LoopExperts(layer.mlp.experts)
    shape = Shape(2, 24)
    d = decompose(zm, shape, "fp32")
    assert d.buffer_bytes >= sum(b.numel() * b.element_size() for b in zm.module.buffers()) > 0
    assert [r.kind for r in d.records if r.cls == "LoopExperts"] == ["experts"] * len(zm.module.model.layers)
    measured = measure_training(zm, shape, "fp32", "adamw", steps=1, warmup=1)
    pred = predict_memory(d, TrainSetup("adamw"))
    assert abs(pred.peak_bytes / measured.peak_bytes - 1) < 0.05, (pred.peak_event, measured.breakdown)
