import torch

from parser_moe import ExpertWeights, aligned_barycenter, decompose, mean_base


def _permuted_family(E=5, inter=12, H=10, noise=0.01, seed=0):
    g = torch.Generator().manual_seed(seed)
    G, U, D = torch.randn(inter, H, generator=g), torch.randn(inter, H, generator=g), torch.randn(H, inter, generator=g)
    perms = [torch.randperm(inter, generator=g) for _ in range(E)]
    gate = torch.stack([G[p] + noise * torch.randn(inter, H, generator=g) for p in perms])
    up = torch.stack([U[p] + noise * torch.randn(inter, H, generator=g) for p in perms])
    down = torch.stack([D[:, p] + noise * torch.randn(H, inter, generator=g) for p in perms])
    return ExpertWeights(gate, up, down)


def test_aligned_barycenter_undoes_unit_permutations():
    w = _permuted_family()
    mean, aligned = mean_base(w), aligned_barycenter(w)
    assert aligned.residual_norm() < 0.01 * mean.residual_norm()
    for e in range(w.num_experts):
        assert sorted(aligned.perms[e].tolist()) == list(range(w.intermediate))


def test_permuting_units_keeps_each_expert_function():
    w = _permuted_family(noise=0.3)
    dec = decompose(w, "aligned")
    x = torch.randn(7, w.hidden)
    act = torch.nn.functional.silu
    for e in range(w.num_experts):
        torch.testing.assert_close(
            dec.experts.expert_forward(e, x, act), w.expert_forward(e, x, act), rtol=1e-5, atol=1e-5
        )
    # base + residual = expert
    torch.testing.assert_close(dec.base_gate + dec.res_gate, dec.experts.gate)
    torch.testing.assert_close(dec.base_down + dec.res_down, dec.experts.down)


def test_mean_base_is_the_mean():
    w = _permuted_family()
    dec = mean_base(w)
    torch.testing.assert_close(dec.base_up, w.up.mean(0))
    try:
        decompose(w, "median")
    except ValueError as e:
        assert "base method must be one of" in str(e)
    else:
        raise AssertionError("bad base method accepted")


def test_aligned_residuals_never_exceed_the_mean_ones():
    g = torch.Generator().manual_seed(3)
    shared = ExpertWeights(
        torch.randn(1, 12, 10, generator=g), torch.randn(1, 12, 10, generator=g), torch.randn(1, 10, 12, generator=g)
    )
    # upcycled-like experts: one common MLP plus large independent changes
    w = ExpertWeights(
        *(
            t.expand(6, *t.shape[1:]) + 0.8 * torch.randn(6, *t.shape[1:], generator=g)
            for t in (shared.gate, shared.up, shared.down)
        )
    )
    assert aligned_barycenter(w).residual_norm() <= mean_base(w).residual_norm() + 1e-4
