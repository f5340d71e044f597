import signal

import pytest
import torch
from dist_helpers import fail_on_rank1, killed_between_layers, layer_parity_both
from torch import nn

from xronos.launch import WorkerError, spawn


def reference(sizes, lora, res):
    torch.manual_seed(0)
    d_in, d_out = 12, 10
    hidden = sum(sizes)
    fc1, fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)
    x = torch.randn(3, 5, d_in, requires_grad=True)
    if lora:
        a1, b1 = res[0]["colA"].clone().requires_grad_(True), res[0]["colB"].clone().requires_grad_(True)
        a2, b2 = res[0]["rowA"].clone().requires_grad_(True), res[0]["rowB"].clone().requires_grad_(True)
        h = fc1(x) + (x @ a1.T) @ b1.T * 2.0
        h = torch.relu(h)
        y = fc2(h) + (h @ a2.T) @ b2.T * 2.0
        grads = lambda: {"colA_g": a1.grad, "colB_g": b1.grad, "rowA_g": a2.grad, "rowB_g": b2.grad}  # noqa: E731
    else:
        y = fc2(torch.relu(fc1(x)))
        grads = lambda: {"w1_g": fc1.weight.grad, "b1_g": fc1.bias.grad, "w2_g": fc2.weight.grad, "b2_g": fc2.bias.grad}  # noqa: E731
    (y * torch.arange(y.numel()).view_as(y).float().sin()).sum().backward()
    return y.detach(), x.grad, grads()


@pytest.fixture(scope="module")
def parity_runs():
    return spawn(layer_parity_both, 2, ([13, 3],), timeout_s=180)  # deliberately uneven and odd


@pytest.mark.parametrize("lora", [False, True])
def test_uneven_pair_matches_nn_linear(lora, parity_runs):
    sizes = [13, 3]
    res = [r[lora] for r in parity_runs]
    y, dx, grads = reference(sizes, lora, res)
    for r in res:
        torch.testing.assert_close(r["y"], y, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["dx"], dx, rtol=1e-5, atol=1e-6)
        for k, v in grads.items():
            torch.testing.assert_close(r[k], v, rtol=1e-5, atol=1e-6 * max(1.0, v.abs().max().item()), msg=k)


def test_single_process_layers_equal_linear():
    torch.manual_seed(0)
    lin = nn.Linear(6, 8)
    x = torch.randn(4, 6)
    col = layer = None
    from xronos.layers import ColumnParallelLinear, RowParallelLinear

    col = ColumnParallelLinear.from_linear(lin, [8], 0)
    layer = RowParallelLinear.from_linear(lin, [6], 0)
    torch.testing.assert_close(col(x), lin(x))
    torch.testing.assert_close(layer(x), lin(x))
    with pytest.raises(ValueError, match="out_sizes sum to 7"):
        ColumnParallelLinear.from_linear(lin, [4, 3], 0)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        ColumnParallelLinear(6, [4, 4], 2)


def test_dead_rank_is_named_not_a_hang():
    with pytest.raises(WorkerError, match="rank 1 .*failed: ValueError: boom on purpose") as info:
        spawn(fail_on_rank1, 2, timeout_s=120, pg_timeout_s=20)
    assert info.value.rank == 1


def test_a_killed_rank_is_blamed_not_the_survivor_left_in_its_all_reduce():
    # rank 1 (emulated at half speed) is SIGKILLed between two tensor-parallel layers; rank 0 then
    # fails in the all-reduce it waits in, and that consequence must not be reported as the cause
    with pytest.raises(WorkerError, match="rank 1 .*killed by SIGKILL") as info:
        spawn(killed_between_layers, 2, speeds=[1.0, 0.5], timeout_s=120, pg_timeout_s=20)
    assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL


@pytest.mark.slow
def test_vocab_parallel_embedding_head_and_loss_match_single_process():
    from dist_helpers import small_cfg, vocab_parity

    from xronos.launch import spawn
    from xronos.train import TPTrainer

    sizes = [13, 4]  # uneven, and not a multiple of anything
    runs = spawn(vocab_parity, 2, (sizes,), timeout_s=300)
    torch.manual_seed(0)
    vocab = sum(sizes)
    emb, head = torch.nn.Embedding(vocab, 6), torch.nn.Linear(6, vocab, bias=False)
    ids = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, vocab, (21,), generator=torch.Generator().manual_seed(2))
    h = emb(ids)
    losses = torch.nn.functional.cross_entropy(head(torch.tanh(h)).reshape(-1, vocab), target, reduction="none")
    (losses * torch.linspace(0.5, 1.5, losses.numel())).sum().backward()
    ref = TPTrainer(small_cfg(), None)
    ref_losses = [ref.step()["loss"] for _ in range(5)]
    for r in runs:
        torch.testing.assert_close(r["h"], h.detach(), rtol=0, atol=0)
        torch.testing.assert_close(r["losses"], losses.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["emb_g"], emb.weight.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["head_g"], head.weight.grad, rtol=1e-5, atol=1e-6)
        assert r["vocab_sizes"][0] > r["vocab_sizes"][1] and sum(r["vocab_sizes"]) == 256
        assert r["train_losses"] + r["after_reshard"] == pytest.approx(ref_losses, rel=1e-5)


def test_weight_gradients_overlap_the_input_gradient_all_reduce():
    from dist_helpers import overlap_parity

    res = spawn(overlap_parity, 2, ([6, 10],), timeout_s=120)
    for r in res:
        # the column weight's GEMM waited for the input-gradient all-reduce, launched before it and
        # not yet recorded (recorded when its wait ends), and ran before backward returned
        assert r["flushes"][0] == (1, r["calls_after_forward"])
        assert r["left_after_backward"] == 0
        assert torch.allclose(r["w_grad"], r["w_grad_ref"], atol=1e-6)
    assert torch.equal(res[0]["dx"], res[1]["dx"])  # the all-reduced input gradient


@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipped and left alone
def test_clipping_matches_torch_clip_grad_norm(max_norm):
    from xronos.layers import ColumnParallelLinear, clip_grad_norm
    from xronos.train import clip_stage_grads

    torch.manual_seed(0)
    col = ColumnParallelLinear(6, [5], 0)  # its weight and bias are marked sharded
    plain = nn.Linear(5, 3)  # replicated
    params = [*col.parameters(), *plain.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    grads = [p.grad.clone() for p in params]
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for c, g in zip(copies, grads):
        c.grad = g.clone()
    want = float(torch.nn.utils.clip_grad_norm_(copies, max_norm))
    assert want > 1.0
    for clip in (clip_grad_norm, clip_stage_grads):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        assert clip(params, max_norm) == pytest.approx(want, rel=1e-6)
        for p, c in zip(params, copies):
            torch.testing.assert_close(p.grad, c.grad, rtol=1e-6, atol=1e-7)
