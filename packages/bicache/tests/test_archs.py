"""The per-layer cache runs through each architecture's own forward: Gemma3, LLaDA-shaped Llama, Dream-shaped Qwen2."""

import pytest
import torch

from bicache import diffusion, kvcache
from bicache.model import DiffusionLM
from bicache.task import TableTask

ARCHS = {
    "gemma3": {"arch": "gemma3"},
    "gemma3-local": {"arch": "gemma3", "local_layers": 2, "window": 3},
    "llama": {"arch": "llama"},  # LLaDA: multi-head attention
    "qwen2": {"arch": "qwen2", "kv_heads": 1},  # Dream: grouped-query attention, biased q/k/v
}


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_dlm(request):
    return DiffusionLM.random(seed=4, layers=4, hidden=32, heads=2, **ARCHS[request.param])


def _inputs(dlm):
    reqs = TableTask(dlm.spec, seed=5).burst(3, 6)
    x = torch.tensor([r.prompt + [dlm.mask_id] * dlm.spec.gen_length for r in reqs])
    return reqs[0].prefix_len, x


def _reference(dlm, x):
    """Uncached bidirectional logits from transformers alone (no bicache hooks acting)."""
    if dlm.layer_types.count("full_attention") == dlm.num_layers:
        # an all-True 4D mask: the model's own attention over every position, no causal mask
        mask = torch.ones(1, 1, x.shape[1], x.shape[1], dtype=torch.bool)
        return dlm.model(input_ids=x, attention_mask=mask).logits
    return dlm.model(input_ids=x).logits  # Gemma3 builds its bidirectional window masks itself


def test_uncached_forward_is_bidirectional_and_matches_transformers(arch_dlm):
    _, x = _inputs(arch_dlm)
    y = x.clone()
    y[:, -1] = arch_dlm.vocab.digit0
    with torch.no_grad():
        ref = _reference(arch_dlm, x)
        mine = kvcache.forward(arch_dlm, x, logits_from=0)
        other = kvcache.forward(arch_dlm, y, logits_from=0)
    torch.testing.assert_close(mine, ref, rtol=0, atol=1e-5)
    assert (mine[:, 0] - other[:, 0]).abs().max() > 1e-6  # the first position sees the last token


@pytest.mark.parametrize("depth", ["all", "partial"])
def test_cached_forward_with_exact_prefix_kv_equals_uncached(arch_dlm, depth):
    p, x = _inputs(arch_dlm)
    n = arch_dlm.num_layers
    d = n if depth == "all" else 2
    with torch.no_grad():
        for row in range(x.shape[0]):
            entry, _ = kvcache.fill_entry(arch_dlm, x[row : row + 1], p)  # this request's own prefix K/V
            cache = kvcache.prefix_cache(arch_dlm, entry, d)
            hid = entry.hidden[d] if d < n else None
            got = kvcache.forward(arch_dlm, x[row : row + 1], cache, start=p, depth=d, prefix_hidden=hid, logits_from=p)
            want = _reference(arch_dlm, x[row : row + 1])[:, p:]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_naive_dynamic_cache_equals_full_depth_splice_cache(arch_dlm):
    p, x = _inputs(arch_dlm)
    with torch.no_grad():
        entry, _ = kvcache.fill_entry(arch_dlm, x[:1], p)
        naive = diffusion.naive_logits(arch_dlm, x, entry)  # a transformers DynamicCache holding the prefix
        n = arch_dlm.num_layers
        splice = kvcache.forward(arch_dlm, x, kvcache.prefix_cache(arch_dlm, entry, n), start=p, depth=n)
    torch.testing.assert_close(naive, splice, rtol=0, atol=1e-5)
    # other requests reuse a K/V their own bidirectional pass would not give: the drift bicache bounds
    assert (naive[1:] - _reference(arch_dlm, x[1:])[:, p:]).abs().max() > 1e-4


def test_block_cache_with_exact_kv_equals_uncached_block(arch_dlm):
    p, x = _inputs(arch_dlm)
    b0 = x.shape[1] - arch_dlm.spec.gen_length
    with torch.no_grad():
        rec = kvcache.prefix_cache(arch_dlm, None, 0, record=True)
        kvcache.forward(arch_dlm, x, rec, logits_from=x.shape[1])
        blk = kvcache.forward(arch_dlm, x, kvcache.block_cache(rec, b0), start=b0, end=b0 + 2, logits_from=b0)
        ref = _reference(arch_dlm, x)[:, b0 : b0 + 2]
    torch.testing.assert_close(blk, ref, rtol=0, atol=1e-5)


def test_every_decode_mode_runs_and_depth_zero_equals_no_cache(arch_dlm):
    p, x = _inputs(arch_dlm)
    prompts = x[:, : x.shape[1] - arch_dlm.spec.gen_length]
    none = diffusion.generate(arch_dlm, prompts, mode="none")
    assert torch.equal(none, diffusion.generate(arch_dlm, prompts, mode="bicache", depth=0, fill_prefix=p))
    for mode in ("naive", "bicache", "block", "bicache+block"):
        out = diffusion.generate(arch_dlm, prompts, mode=mode, depth=2, fill_prefix=p)
        assert out.shape == none.shape and not (out == arch_dlm.mask_id).any()


def test_eager_attention_takes_the_same_masks():
    sdpa = DiffusionLM.random(seed=6, layers=3, hidden=32, heads=2, local_layers=2, window=3)
    eager = DiffusionLM.random(seed=6, layers=3, hidden=32, heads=2, local_layers=2, window=3)
    eager.model.config._attn_implementation = "eager"
    for layer in eager.layers:
        layer.self_attn.config._attn_implementation = "eager"
    p, x = _inputs(sdpa)
    with torch.no_grad():
        for dlm in (sdpa, eager):
            entry, _ = kvcache.fill_entry(dlm, x[:1], p)
            dlm.out = kvcache.forward(dlm, x, kvcache.prefix_cache(dlm, entry, 3), start=p, depth=3)
    torch.testing.assert_close(eager.out, sdpa.out, rtol=0, atol=1e-5)


def test_hooks_leave_plain_calls_of_the_model_alone():
    dlm = DiffusionLM.random(seed=7, layers=2, hidden=32, heads=2, arch="llama")
    _, x = _inputs(dlm)
    with torch.no_grad():
        before = dlm.model(input_ids=x).logits
        kvcache.forward(dlm, x, logits_from=0)  # installs the hooks
        after = dlm.model(input_ids=x).logits
    assert torch.equal(before, after)  # the stock (causal) call is unchanged outside bicache's forward


def test_a_model_with_uncacheable_layers_is_refused_naming_the_layer_type():
    from transformers import MambaConfig, MambaForCausalLM

    dlm = DiffusionLM.random(seed=0, layers=2, hidden=32, heads=2)
    cfg = MambaConfig(
        vocab_size=len(dlm.vocab), hidden_size=16, state_size=4, num_hidden_layers=2, use_bidirectional_attention=True
    )
    with pytest.raises(ValueError, match=r"cannot cache MambaBlock layers \(layer 0 of MambaForCausalLM\)"):
        DiffusionLM(MambaForCausalLM(cfg), dlm.vocab, dlm.spec)
    with pytest.raises(ValueError, match="arch must be one of gemma3, llama, qwen2"):
        DiffusionLM.random(arch="mamba")
    with pytest.raises(ValueError, match="local_layers needs arch='gemma3'"):
        DiffusionLM.random(arch="llama", local_layers=1)
