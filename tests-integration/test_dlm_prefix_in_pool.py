"""DLM prefix KV in the pool: bicache's shallow-layer prefix state goes through kvpool to a second process.

Process A (this one) fills a bicache prefix entry for a shared prompt prefix and stores, in a kvpool
on an SSD slab (O_DIRECT), the K/V of the reused (shallow) layers plus the hidden state entering the
first recomputed layer, carried as one extra (K, V) "layer" of the pool's layout. Process B opens the
same pool, loads the prefix back layer-wise, rebuilds the entry and decodes: its answers must be
identical to A's decode with the in-memory entry.
"""

import multiprocessing as mp

import torch

import bicache
import kvpool

PREFIX, SUFFIX, CHUNK, DEPTH = 32, 8, 16, 2  # 2 pool chunks of prefix; layers < 2 reuse it
DECODE = bicache.DecodeConfig(gen_length=4, block_length=2, steps=4)


def layout_for(dlm: bicache.DiffusionLM) -> kvpool.KVLayout:
    cfg = dlm.config
    # layers < DEPTH carry the prefix K/V; one more layer carries the hidden state entering DEPTH
    return kvpool.KVLayout(DEPTH + 1, cfg.num_key_value_heads, cfg.head_dim, "float32", CHUNK)


def open_pool(ssd_dir: str, dlm: bicache.DiffusionLM) -> kvpool.KVPool:
    devs = kvpool.build_devices([ssd_dir], memory_modules=0, ssd_bytes=8 << 20, measure=False)
    assert not devs.skipped, devs.skipped
    return kvpool.KVPool(devs.stores, layout_for(dlm), "bicache-random-seed0", devs.bandwidths)


def prompts_for(dlm: bicache.DiffusionLM) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    words = torch.arange(4, len(dlm.vocab))  # skip pad/mask/bos/eos
    pick = words[torch.randint(0, len(words), (PREFIX + 2 * SUFFIX,), generator=g)]
    prefix = pick[:PREFIX]
    return torch.stack([torch.cat([prefix, pick[PREFIX:PREFIX + SUFFIX]]),
                        torch.cat([prefix, pick[PREFIX + SUFFIX:]])])  # fmt: skip


def second_process(ckpt: str, ssd_dir: str, q) -> None:
    torch.set_num_threads(1)
    dlm = bicache.DiffusionLM.load(ckpt)
    prompts = prompts_for(dlm)
    tokens = prompts[0, :PREFIX].tolist()
    with open_pool(ssd_dir, dlm) as pool:
        hit = pool.lookup(tokens)
        load = pool.retrieve(tokens).join()
        assert not load.lost, f"chunks lost: {load.lost}"
        kv = [(load.k[i].clone(), load.v[i].clone()) for i in range(DEPTH + 1)]
    n, (b, h, p, d) = dlm.num_layers, kv[0][0].shape
    hidden_at_depth = kv[DEPTH][0].transpose(1, 2).reshape(b, p, h * d)
    unused = torch.zeros(1, h, p, d)
    entry = bicache.PrefixEntry(
        tokens=tuple(tokens),
        keys=[kv[i][0] for i in range(DEPTH)] + [unused] * (n - DEPTH),
        values=[kv[i][1] for i in range(DEPTH)] + [unused] * (n - DEPTH),
        hidden=[hidden_at_depth if i == DEPTH else torch.zeros(1, p, h * d) for i in range(n + 1)],
    )
    out = bicache.generate(dlm, prompts, DECODE, mode="bicache", depth=DEPTH, entry=entry)
    # plain lists: tensors would travel as shared-memory handles that die with this process
    q.put({"hit": hit, "answers": out.tolist(), "k0": kv[0][0].tolist(), "hidden": hidden_at_depth.tolist()})


def test_prefix_kv_through_kvpool_in_a_second_process(tmp_path):
    dlm = bicache.DiffusionLM.random(seed=0, layers=4, hidden=64, heads=4)
    ckpt = dlm.save(tmp_path / "dlm")
    dlm = bicache.DiffusionLM.load(ckpt)  # the same weights process B loads
    prompts = prompts_for(dlm)
    entry, _ = bicache.fill_entry(dlm, prompts, PREFIX)
    in_memory = bicache.generate(dlm, prompts, DECODE, mode="bicache", depth=DEPTH, entry=entry)
    # the prefix cache really changes the computation (otherwise "identical" would prove nothing)
    assert entry.length == PREFIX and DEPTH < dlm.num_layers

    b, p, hd = entry.hidden[DEPTH].shape
    h = dlm.config.num_key_value_heads
    hidden_as_kv = entry.hidden[DEPTH].reshape(b, p, h, hd // h).transpose(1, 2).contiguous()
    kv = [(entry.keys[i], entry.values[i]) for i in range(DEPTH)] + [(hidden_as_kv, hidden_as_kv)]
    ssd = tmp_path / "ssd0"
    ssd.mkdir()
    with open_pool(str(ssd), dlm) as pool:
        assert pool.put(list(entry.tokens), kv) == PREFIX // CHUNK

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=second_process, args=(str(ckpt), str(ssd), q))
    proc.start()
    try:
        got = q.get(timeout=240)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    assert got["hit"] == PREFIX
    assert torch.equal(torch.tensor(got["k0"]), entry.keys[0])  # exact round trip through the O_DIRECT slab
    assert torch.equal(torch.tensor(got["hidden"]), entry.hidden[DEPTH])
    assert got["answers"] == in_memory.tolist()
