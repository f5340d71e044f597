import pytest
import torch

from bicache import diffusion, kvcache
from bicache.depth import kv_drift
from bicache.model import DiffusionLM, tiny_config


def _batch(dlm, task, rows=3, n=4):
    reqs = task.burst(n, rows)
    prompts = torch.tensor([r.prompt for r in reqs])
    full = torch.cat([prompts, torch.full((n, dlm.spec.gen_length), dlm.mask_id)], 1)
    return reqs, prompts, full


def test_attention_is_bidirectional(dlm, task):
    _, _, x = _batch(dlm, task)
    y = x.clone()
    y[:, -1] = dlm.vocab.digit0  # change only the last token
    with torch.no_grad():
        a, b = dlm.model(input_ids=x).logits, dlm.model(input_ids=y).logits
    # position 0 sees the last token: bidirectional attention
    assert (a[:, 0] - b[:, 0]).abs().max() > 1e-6
    from transformers import Gemma3ForCausalLM

    cfg = tiny_config(len(dlm.vocab), layers=2, hidden=32, heads=2)
    cfg.use_bidirectional_attention = False
    causal = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        c, d = causal(input_ids=x).logits, causal(input_ids=y).logits
    assert torch.equal(c[:, :-1], d[:, :-1])
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        DiffusionLM(causal, dlm.vocab, dlm.spec)


def test_cached_path_forward_equals_transformers_forward(dlm, task):
    _, _, x = _batch(dlm, task)
    with torch.no_grad():
        ref = dlm.model(input_ids=x).logits
        mine = kvcache.forward(dlm, x, logits_from=0)
    assert torch.equal(ref, mine)


def test_depth_zero_is_bit_identical_to_no_cache(dlm, task):
    reqs, prompts, x = _batch(dlm, task)
    with torch.no_grad():
        entry, _ = kvcache.fill_entry(dlm, x[:1], reqs[0].prefix_len)
        c = kvcache.prefix_cache(dlm, entry, 0)
        a = kvcache.forward(dlm, x, c, start=0, depth=0, logits_from=0)
        b = dlm.model(input_ids=x).logits
    assert torch.equal(a, b)
    s0 = diffusion.generate(dlm, prompts, mode="none")
    s1 = diffusion.generate(dlm, prompts, mode="bicache", depth=0, entry=entry)
    assert torch.equal(s0, s1)


def test_full_depth_equals_naive_prefix_cache(dlm, task):
    reqs, prompts, x = _batch(dlm, task)
    p = reqs[0].prefix_len
    with torch.no_grad():
        entry, _ = kvcache.fill_entry(dlm, x[:1], p)
        naive = diffusion.naive_logits(dlm, x, entry)  # stock forward on a transformers DynamicCache
        full = kvcache.forward(dlm, x, kvcache.prefix_cache(dlm, entry, dlm.num_layers), start=p, depth=dlm.num_layers)
    torch.testing.assert_close(full, naive, rtol=0, atol=1e-6)
    a = diffusion.generate(dlm, prompts, mode="naive", entry=entry)
    b = diffusion.generate(dlm, prompts, mode="bicache", depth=dlm.num_layers, entry=entry)
    assert torch.equal(a, b)


def test_prefix_kv_is_not_invariant(dlm, task):
    """Drift is measured: reused prefix K/V differ from fresh ones beyond layer 0."""
    reqs, _, x = _batch(dlm, task, rows=2)
    p = reqs[0].prefix_len
    with torch.no_grad():
        entry, _ = kvcache.fill_entry(dlm, x[:1], p)
        keys, values = kvcache.layer_kv(dlm, x[1:])
    d0 = kv_drift(entry.keys[0], keys[0][:, :, :p])
    assert torch.all(d0 == 0)  # layer 0 K/V depend on the token alone
    for layer in range(1, dlm.num_layers):
        assert torch.all(kv_drift(entry.keys[layer], keys[layer][:, :, :p]) > 1e-4)
    # and so the reused-prefix logits of another request differ from its fresh logits
    with torch.no_grad():
        fresh = dlm.model(input_ids=x[1:]).logits[:, p:]
        naive = diffusion.naive_logits(dlm, x[1:], entry)
    assert (fresh - naive).abs().max() > 1e-4
    # the request that filled the entry gets its own logits back at any depth
    for depth in range(dlm.num_layers + 1):
        c = kvcache.prefix_cache(dlm, entry, depth)
        hid = entry.hidden[depth] if 0 < depth < dlm.num_layers else None
        with torch.no_grad():
            own = kvcache.forward(dlm, x[:1], c, start=p if depth else 0, depth=depth, prefix_hidden=hid, logits_from=p)
            ref = dlm.model(input_ids=x[:1]).logits[:, p:]
        torch.testing.assert_close(own, ref, rtol=0, atol=1e-5)


def test_block_cache_refresh_and_dual_steps(dlm, task):
    _, prompts, x = _batch(dlm, task)
    cfg = diffusion.DecodeConfig(4, 2, 4)
    # one token per step: the refresh step equals the no-cache step; block steps reuse stale K/V
    stats = diffusion.DecodeStats()
    out = diffusion.generate(dlm, prompts, cfg, mode="block", stats=stats)
    assert out.shape == (prompts.shape[0], 4)
    assert stats.forwards == 4
    full = dlm.num_layers * x.shape[1]
    assert stats.tokens_computed == prompts.shape[0] * (2 * full + 2 * dlm.num_layers * 2)  # over the batch
    # a block cache holding exact K/V gives the exact logits for the block
    with torch.no_grad():
        rec = kvcache.prefix_cache(dlm, None, 0, record=True)
        kvcache.forward(dlm, x, rec, logits_from=x.shape[1])
        b0 = prompts.shape[1]
        blk = kvcache.forward(dlm, x, kvcache.block_cache(rec, b0), start=b0, end=b0 + 2, logits_from=b0)
        ref = dlm.model(input_ids=x).logits[:, b0 : b0 + 2]
    torch.testing.assert_close(blk, ref, rtol=0, atol=1e-5)


def test_mismatched_cache_and_model_errors(dlm, task):
    reqs, prompts, x = _batch(dlm, task)
    with torch.no_grad():
        entry, _ = kvcache.fill_entry(dlm, x[:1], reqs[0].prefix_len)
    other = DiffusionLM.random(seed=1, layers=2, hidden=32, heads=2)
    with pytest.raises(ValueError, match="mismatched cache and model"):
        kvcache.prefix_cache(other, entry, 1)
    with pytest.raises(ValueError, match="another model"):
        diffusion.generate(other, prompts, mode="bicache", depth=1, entry=entry)
    with pytest.raises(ValueError, match="not a prefix"):
        diffusion.generate(dlm, prompts.flip(1), mode="bicache", depth=1, entry=entry)
    with pytest.raises(ValueError, match="depth must lie"):
        kvcache.prefix_cache(dlm, entry, dlm.num_layers + 1)
    with pytest.raises(ValueError, match="positions"):
        diffusion.generate(dlm, torch.ones(1, dlm.max_length, dtype=torch.long), mode="none")
    with pytest.raises(ValueError, match="non-empty"):
        diffusion.generate(dlm, torch.ones(1, 0, dtype=torch.long), mode="none")
    with pytest.raises(ValueError, match="block_length"):
        diffusion.generate(dlm, prompts, diffusion.DecodeConfig(4, 3, 4))


def test_local_layers_forward_matches_transformers_and_drift_stays_near_the_boundary(task):
    # Gemma3 sliding-window (local) layers: bicache's forward gives them the bidirectional window
    # mask itself and must match the stock forward; the prefix K/V of layer l <= local_layers (computed
    # from local layers' outputs only) differ between two requests only within l * (window - 1)
    # positions of the end of the shared prefix; past a global layer they drift everywhere (measured)
    local = DiffusionLM.random(seed=1, layers=4, hidden=32, heads=2, local_layers=2, window=3)
    reqs = task.burst(2, 8)
    p = reqs[0].prefix_len
    x = torch.tensor([r.prompt + [local.mask_id] * local.spec.gen_length for r in reqs])
    with torch.no_grad():
        assert torch.equal(local.model(input_ids=x).logits, kvcache.forward(local, x, logits_from=0))
        cache = kvcache.prefix_cache(local, None, 0, record=True)
        kvcache.forward(local, x, cache=cache, logits_from=x.shape[1])
        entry, _ = kvcache.fill_entry(local, x[:1], p)
        out = kvcache.forward(
            local,
            x[:1],
            kvcache.prefix_cache(local, entry, 2),
            start=p,
            depth=2,
            prefix_hidden=entry.hidden[2],
            logits_from=p,
        )
    assert torch.equal(out, local.model(input_ids=x[:1]).logits[:, p:])  # own entry: exact reuse
    for layer in range(4):
        k = cache.layers[layer].keys[:, :, :p]
        moved = (k[0] - k[1]).abs().amax(dim=(0, 2)) > 0
        stable = p - layer * (local.config.sliding_window - 1)
        if layer <= 2:
            assert not moved[:stable].any() and (layer == 0 or moved[stable:].any())
        else:  # the global layer: drift reaches the start of the prefix
            assert moved[0]


def test_splice_layer_buffer_reuse_and_inplace_equal_concatenation():
    torch.manual_seed(0)
    prefix_k, prefix_v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    layer = kvcache.SpliceLayer(prefix_k.clone(), prefix_v.clone(), 5)
    for _ in range(3):  # one layer reused over denoising steps: the prefix is copied once, the span every step
        fk, fv = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
        k, v = layer.update(fk, fv)
        assert torch.equal(k, torch.cat([prefix_k.expand(3, -1, -1, -1), fk], 2))
        assert torch.equal(v, torch.cat([prefix_v.expand(3, -1, -1, -1), fv], 2))
    assert torch.equal(layer.keys, prefix_k)  # the stored entry is never written
    k2, _ = layer.update(torch.randn(2, 2, 4, 4), torch.randn(2, 2, 4, 4))  # another batch: a new buffer
    assert k2.shape == (2, 2, 9, 4) and torch.equal(k2[:, :, :5], prefix_k.expand(2, -1, -1, -1))
    # dual block cache: the refresh pass's own K/V take the block in place, the rest is untouched
    own_k, own_v = torch.randn(3, 2, 9, 4), torch.randn(3, 2, 9, 4)
    ref_k = own_k.clone()
    block = kvcache.SpliceLayer(own_k, own_v, 5, inplace=True)
    fk = torch.randn(3, 2, 2, 4)
    k, _ = block.update(fk, torch.randn(3, 2, 2, 4))
    assert k.data_ptr() == own_k.data_ptr()
    assert torch.equal(k, torch.cat([ref_k[:, :, :5], fk, ref_k[:, :, 7:]], 2))


def test_a_new_prefix_is_filled_from_the_first_request_alone(dlm, task):
    reqs, prompts, x = _batch(dlm, task)
    p = reqs[0].prefix_len
    stats = diffusion.DecodeStats()
    out = diffusion.generate(dlm, prompts, mode="bicache", depth=2, stats=stats, fill_prefix=p)
    with torch.no_grad():
        ref_entry, _ = kvcache.fill_entry(dlm, x[:1], p)  # the first request, answer masked, on its own
    assert stats.entry.tokens == ref_entry.tokens
    for a, b in zip(stats.entry.keys + stats.entry.hidden, ref_entry.keys + ref_entry.hidden):
        assert torch.equal(a, b)
    # every step of the batch, the first included, then reuses it: the same as decoding with the entry given
    assert torch.equal(out, diffusion.generate(dlm, prompts, mode="bicache", depth=2, entry=ref_entry))
    assert stats.forwards == 1 + 4
