import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvpool import KVPool, MemoryStore, PassthroughStore, unit_name
from kvpool.hf import PoolCache, layout_for, prefill
from kvpool.passthrough import HEADER_BYTES


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    return LlamaForCausalLM(cfg).eval()


def make_pool(model, dirs, model_id="tiny-llama"):
    lay = layout_for(model, chunk_tokens=32)
    stores = [MemoryStore("mem0", 2 * lay.chunk_bytes), MemoryStore("mem1", 2 * lay.chunk_bytes)]
    stores += [PassthroughStore(f"ssd{i}", d, 1 << 20) for i, d in enumerate(dirs)]
    return KVPool(stores, lay, model_id, {"mem0": 8e9, "mem1": 8e9, "ssd0": 1e9, "ssd1": 1e9})


def full(model, ids):
    return prefill(model, ids, None).logits


def test_warm_prefill_skips_the_cached_prefix_and_matches_recompute(model, ssd_dirs):
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    ref = full(model, ids)
    with make_pool(model, ssd_dirs) as pool:
        cold = prefill(model, ids, pool)
        assert cold.cached_tokens == 0 and cold.stored_chunks == 9
        warm = prefill(model, ids, pool)
        assert warm.cached_tokens == 288 and warm.computed_tokens == 12
        assert torch.equal(warm.logits, ref)
        assert warm.retrieval["valid_tokens"] == 288
        # a follow-up turn that shares the first 200 tokens reuses 192 of them
        ids2 = torch.cat([ids[:, :200], torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(2))], 1)
        r = prefill(model, ids2, pool)
        assert r.cached_tokens == 192
        torch.testing.assert_close(r.logits, full(model, ids2), rtol=1e-5, atol=1e-5)


def test_exact_chunk_multiple_keeps_one_token_to_compute(model, ssd_dirs):
    ids = torch.randint(0, 128, (1, 128), generator=torch.Generator().manual_seed(3))
    with make_pool(model, ssd_dirs) as pool:
        prefill(model, ids, pool)
        warm = prefill(model, ids, pool)
        assert warm.cached_tokens == 96 and warm.computed_tokens == 32
        torch.testing.assert_close(warm.logits, full(model, ids), rtol=1e-5, atol=1e-5)


def test_generation_continues_after_a_pool_prefill(model, ssd_dirs):
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(4))
    with make_pool(model, ssd_dirs) as pool:
        prefill(model, ids, pool)
        warm = prefill(model, ids, pool, store=False)
        nxt = warm.logits.argmax(-1, keepdim=True)
        with torch.no_grad():
            step = model(input_ids=nxt, cache=warm.cache, use_cache=True).logits[:, -1]
            ref = model(input_ids=torch.cat([ids, nxt], 1)).logits[:, -1]
        torch.testing.assert_close(step, ref, rtol=1e-5, atol=1e-5)


def test_corrupt_chunk_falls_back_to_recompute_never_wrong_output(model, ssd_dirs):
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(5))
    ref = full(model, ids)
    with make_pool(model, ssd_dirs) as pool:
        prefill(model, ids, pool)
        ssd_keys = [k for k in pool.keys(ids[0].tolist()) if pool.placement.location(k.hex).startswith("ssd")]
        victim = ssd_keys[0]
        store = pool.stores[pool.placement.location(victim.hex)]
        off = store.index[unit_name(victim, 1)][0]
        with open(store.slab_path, "r+b") as f:
            f.seek(off + HEADER_BYTES)
            f.write(b"\xff" * 16)
        r = prefill(model, ids, pool)
        assert r.fallback is not None and r.cached_tokens == 0
        assert torch.equal(r.logits, ref)
        again = prefill(model, ids, pool)  # rewritten by the fallback's put
        assert again.cached_tokens == 288 and torch.equal(again.logits, ref)


def test_other_model_id_gets_no_hit(model, ssd_dirs):
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(6))
    with make_pool(model, ssd_dirs) as pool:
        prefill(model, ids, pool)
        other = KVPool(list(pool.stores.values()), pool.layout, "another-model", {n: 1e9 for n in pool.stores})
        assert prefill(model, ids, other, store=False).cached_tokens == 0


def test_pool_cache_rejects_sliding_window_models(ssd_dirs):
    from transformers import MistralConfig

    cfg = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        sliding_window=8,
    )

    class Load:
        tokens = 0

    with pytest.raises(ValueError, match="full-attention"):
        PoolCache(Load(), cfg)
    with pytest.raises(ValueError, match="shape"):
        prefill(None, torch.zeros(2, 3, dtype=torch.long), None)
