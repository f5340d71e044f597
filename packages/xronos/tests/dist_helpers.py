"""Worker functions for spawned tests (module level so that spawn can pickle them)."""

import torch
from torch import nn

from xronos.layers import ColumnParallelLinear, RowParallelLinear, gather_uneven, sync_partial_grads


def layer_parity_both(rank, world, sizes):
    return {lora: layer_parity(rank, world, sizes, lora) for lora in (False, True)}


def layer_parity(rank, world, sizes, lora):
    torch.manual_seed(0)
    d_in, d_out = 12, 10
    hidden = sum(sizes)
    fc1, fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)
    x = torch.randn(3, 5, d_in, requires_grad=True)
    col = ColumnParallelLinear.from_linear(fc1, sizes, rank)
    row = RowParallelLinear.from_linear(fc2, sizes, rank)
    if lora:
        g = torch.Generator().manual_seed(1)
        col.enable_lora(4, 8.0, g)
        row.enable_lora(4, 8.0, g)
        with torch.no_grad():  # non-zero B so the adapters change the output
            col.lora_B.normal_(generator=torch.Generator().manual_seed(2 + rank))
            row.lora_B.copy_(torch.randn(row.lora_B.shape, generator=torch.Generator().manual_seed(9)))
    xs = x.detach().clone().requires_grad_(True)
    y = row(torch.relu(col(xs)))
    (y * torch.arange(y.numel()).view_as(y).float().sin()).sum().backward()
    sync_partial_grads(nn.ModuleList([col, row]))
    out = {"y": y.detach(), "dx": xs.grad, "rank": rank}
    if lora:
        out.update(
            colA=col.lora_A.detach(),
            colA_g=col.lora_A.grad,
            colB=gather_uneven(col.lora_B, sizes, 0),
            colB_g=gather_uneven(col.lora_B.grad, sizes, 0),
            rowA=gather_uneven(row.lora_A, sizes, 1),
            rowA_g=gather_uneven(row.lora_A.grad, sizes, 1),
            rowB=row.lora_B.detach(),
            rowB_g=row.lora_B.grad,
        )
    else:
        out.update(
            w1_g=gather_uneven(col.weight.grad, sizes, 0),
            b1_g=gather_uneven(col.bias.grad, sizes, 0),
            w2_g=gather_uneven(row.weight.grad, sizes, 1),
            b2_g=row.bias.grad,
        )
    return out


def fail_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits for the dead rank: must end as an error, not a hang
    return rank


def killed_between_layers(rank, world):
    """A Megatron pair twice; rank 1 is SIGKILLed after the first, leaving rank 0 in the second's all-reduce."""
    import os
    import signal

    torch.manual_seed(0)
    col = ColumnParallelLinear.from_linear(nn.Linear(8, 16), [8, 8], rank)
    row = RowParallelLinear.from_linear(nn.Linear(16, 8), [8, 8], rank)
    x = torch.randn(2, 8)
    y = row(torch.relu(col(x)))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"y": row(torch.relu(col(y)))}


def hf_parity(rank, world, families, attn_units, mlp_units, save_dir):
    return {f: _hf_parity(rank, f, attn_units, mlp_units, f"{save_dir}/{f}") for f in families}


def _hf_parity(rank, family, attn_units, mlp_units, save_dir):
    import torch.distributed as dist

    from xronos.partition import ModelShape, Partition
    from xronos.shard import build_model, gather_state_dict, save_full, shard_model, tiny_config

    cfg = tiny_config(
        family, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4
    )
    shape = ModelShape.from_config(cfg, mlp_block=8)
    part = Partition(shape, tuple(attn_units), tuple(mlp_units))
    model = shard_model(build_model(cfg, seed=3), part, rank)
    attn = model.model.layers[0].self_attn
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "shard_dim"):
            from xronos.layers import gather_uneven

            grads[name + ".weight"] = gather_uneven(mod.weight.grad, mod.sizes, mod.shard_dim)
    grads["model.norm.weight"] = model.model.norm.weight.grad.clone()
    grads["model.embed_tokens.weight"] = model.model.embed_tokens.weight.grad.clone()
    state = gather_state_dict(model)
    save_full(model, save_dir, rank=rank)
    dist.barrier()
    return {
        "logits": out.logits.detach(),
        "loss": out.loss.item(),
        "grads": grads,
        "state": state,
        "heads": (attn.num_heads, attn.num_key_value_heads, attn.q_proj.out_features, attn.k_proj.out_features),
    }


def small_cfg(**kw):
    from xronos.train import TrainConfig

    base = dict(
        hidden=64,
        layers=2,
        heads=8,
        kv_heads=4,
        intermediate=128,
        mlp_block=16,
        seq_len=32,
        batch=2,
        micro_batches=2,
        steps=4,
        eval_batches=1,
        max_bytes=200_000,
        lr=1e-3,
        vocab_parallel="none",
    )
    base.update(kw)
    return TrainConfig(**base)


def train_checks(rank, world, ckpt_dir):
    from xronos.partition import Partition
    from xronos.shard import gather_state_dict
    from xronos.train import PPTrainer, TPTrainer

    cfg = small_cfg()
    part = Partition(cfg.shape(), (3, 1), (5, 3))
    a = TPTrainer(cfg, part, rank)
    full = [a.step()["loss"] for _ in range(4)]
    eval_a = a.evaluate()
    state_a = gather_state_dict(a.model)
    b = TPTrainer(cfg, part, rank)
    first = [b.step()["loss"] for _ in range(2)]
    b.save(ckpt_dir)
    c = TPTrainer(cfg, part, rank)
    assert c.load(ckpt_dir) and c.step_idx == 2
    resumed = first + [c.step()["loss"] for _ in range(2)]
    state_c = gather_state_dict(c.model)
    same = all(torch.equal(state_a[k], state_c[k]) for k in state_a)
    wrong = TPTrainer(cfg, Partition(cfg.shape(), (2, 2), (4, 4)), rank)
    try:
        wrong.load(ckpt_dir)
        mismatch = None
    except ValueError as e:
        mismatch = str(e)
    lcfg = small_cfg(lora_r=4)
    lora = TPTrainer(lcfg, part, rank)
    lora_losses = [lora.step()["loss"] for _ in range(3)]
    n_trainable = sum(p.numel() for p in lora.params)
    pp = PPTrainer(cfg, [1.0, 0.5], rank, world)
    pp_losses = [pp.step()["loss"] for _ in range(2)]
    pp_lora = PPTrainer(lcfg, [1.0, 0.5], rank, world)
    pp_lora_losses = [pp_lora.step()["loss"] for _ in range(3)]
    pp_lora_trainable = sum(p.numel() for p in pp_lora.params)
    return {
        "runner": runner_checks(rank, world, ckpt_dir + "/runner"),
        "reshard": reshard_checks(rank, world),
        "full": full,
        "eval": eval_a,
        "resumed": resumed,
        "same_state": same,
        "mismatch": mismatch,
        "state": state_a,
        "lora": lora_losses,
        "lora_params": n_trainable,
        "pp": pp_losses,
        "pp_eval": pp.evaluate(),
        "pp_lora": pp_lora_losses,
        "pp_lora_params": pp_lora_trainable,
    }


# the exact-reshard cases: full fine-tuning, LoRA, the LM head split by vocabulary (the bench's default:
# its shards follow the MLP split, so an MLP reshard re-cuts it) and Qwen2 (q/k/v biases) with the
# embedding split too
RESHARD_CASES = {
    0: {},
    4: {"lora_r": 4},
    "head": {"vocab_parallel": "head"},
    "qwen2-both": {"vocab_parallel": "both", "family": "qwen2"},
}


def reshard_checks(rank, world):
    from xronos.partition import Partition
    from xronos.rebalance import repartition
    from xronos.shard import gather_state_dict
    from xronos.train import TPTrainer

    out = {}
    for lora in RESHARD_CASES:
        cfg = small_cfg(**RESHARD_CASES[lora])
        t = TPTrainer(cfg, Partition(cfg.shape(), (3, 1), (5, 3)), rank)
        losses = [t.step()["loss"] for _ in range(2)]
        repartition(t, Partition(cfg.shape(), (1, 3), (2, 6)))
        heads = (t.model.model.layers[0].self_attn.num_heads, t.model.model.layers[0].mlp.up_proj.out_features)
        losses += [t.step()["loss"] for _ in range(2)]
        # only the MLP split moves: attention keeps its local shards, only the MLP is re-cut
        repartition(t, Partition(cfg.shape(), (1, 3), (3, 5)))
        losses += [t.step()["loss"] for _ in range(2)]
        out[lora] = {"losses": losses, "heads": heads, "state": gather_state_dict(t.model)}
    return out


def runner_checks(rank, world, ckpt_dir):
    """xronos train's worker twice in one group: even TP for 2 steps, then resume under Xronos and save."""
    from xronos.runner import finetune_rank

    first = finetune_rank(rank, world, small_cfg(steps=2).to_dict(), "tp", ckpt_dir, 1, None, None)
    second = finetune_rank(rank, world, small_cfg(steps=3).to_dict(), "xronos", ckpt_dir, 0, ckpt_dir + "/model", None)
    return {"first": first, "second": second, "model": ckpt_dir + "/model"}


def vocab_parity(rank, world, sizes):
    """Uneven vocab-parallel embedding + LM head + cross-entropy on ``sizes`` rows, and a short
    vocab-parallel fine-tune with an uneven partition."""
    from xronos.layers import VocabParallelEmbedding, gather_uneven, vocab_parallel_cross_entropy
    from xronos.partition import costs_from_speeds, partition
    from xronos.train import TPTrainer

    torch.manual_seed(0)
    vocab, dim = sum(sizes), 6
    emb, head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab, bias=False)
    ids = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, vocab, (21,), generator=torch.Generator().manual_seed(2))
    pemb = VocabParallelEmbedding.from_embedding(emb, sizes, rank)
    phead = ColumnParallelLinear.from_linear(head, sizes, rank, sync_input_grad=True)
    h = pemb(ids)
    logits = phead(torch.tanh(h)).reshape(-1, phead.out_features)
    losses = vocab_parallel_cross_entropy(logits, target, sum(sizes[:rank]))
    (losses * torch.linspace(0.5, 1.5, losses.numel())).sum().backward()
    out = {
        "h": h.detach(),
        "losses": losses.detach(),
        "emb_g": gather_uneven(pemb.weight.grad, sizes, 0),
        "head_g": gather_uneven(phead.weight.grad, sizes, 0),
    }
    cfg = small_cfg(vocab_parallel="both")
    shape = cfg.shape()
    part = partition(shape, costs_from_speeds([1.0, 0.5], shape))
    tr = TPTrainer(cfg, part, rank, None)
    out["train_losses"] = [tr.step()["loss"] for _ in range(3)]
    out["eval"] = tr.evaluate()
    out["vocab_sizes"] = part.vocab_sizes(256)
    from xronos.partition import even_partition
    from xronos.rebalance import repartition

    repartition(tr, even_partition(shape, 2))  # reshard the split embedding/head too, exactly
    out["after_reshard"] = [tr.step()["loss"] for _ in range(2)]
    return out


def dilation_at_syncs(rank, world):
    """A few all-reduces and a send/receive with compute in between; what the rank's dilation saw."""
    import torch.distributed as dist

    import hwtopo
    from xronos.layers import all_reduce
    from xronos.train import PPTrainer

    x = torch.randn(64, 64)
    t = torch.zeros(8)
    for _ in range(3):
        for _ in range(20):
            x = torch.tanh(x @ x)
        all_reduce(t)
    if rank == 0:
        PPTrainer._p2p(dist.send, t, 1)
    else:
        PPTrainer._p2p(dist.recv, t, 0)
    d = hwtopo.current_dilation()  # None on an unemulated rank (speed 1.0)

    def points():
        return 0 if d is None else d.points

    # a Megatron pair, forward and backward (on every rank: they are collectives): the row layer's
    # all-reduce runs in forward, the column layer's input-gradient all-reduce inside autograd's
    # backward; both must be sync points
    torch.manual_seed(0)
    col = ColumnParallelLinear.from_linear(nn.Linear(16, 32), [16, 16], rank)
    row = RowParallelLinear.from_linear(nn.Linear(32, 16), [16, 16], rank)
    inp = torch.randn(4, 16, requires_grad=True)
    before = points()
    y = row(torch.relu(col(inp)))
    fwd = points() - before
    before = points()
    y.sum().backward()
    bwd = points() - before
    if d is None:
        return None
    return d.describe() | {"tp_forward_syncs": fwd, "tp_backward_syncs": bwd}


def kernel_samples(rank, world, samples):
    """Every rank's calibrated-kernel time, ``samples`` times (all ranks together each time)."""
    from xronos.emulation import measure_kernel

    return [measure_kernel(repeats=40) for _ in range(samples)]


def own_quota(rank, world):
    """Quota and shares of the cgroup v1 cpu group this rank runs in, None when in none."""
    from xronos.emulation import cgroup_cpu

    return cgroup_cpu()


def library_baselines(rank, world, cfg_dict):
    """Losses of DTensor's even TP and of torch.distributed.pipelining (GPipe, 1F1B) on this rank."""
    from xronos.baselines import DTensorTPTrainer, PipeliningTrainer
    from xronos.train import TrainConfig

    cfg = TrainConfig(**cfg_dict)
    out = {}
    t = DTensorTPTrainer(cfg)
    out["dtensor"] = [t.step()["loss"] for _ in range(cfg.steps)] + [t.evaluate()]
    for schedule in ("gpipe", "1f1b"):
        p = PipeliningTrainer(cfg, [1.0] * world, schedule)
        out[schedule] = [p.step()["loss"] for _ in range(cfg.steps)] + [p.evaluate()]
    return out


def overlap_parity(rank, world, sizes):
    """A column layer's weight gradient, deferred to the all-reduce it overlaps, against autograd's."""
    from xronos import layers

    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(8, sum(sizes)), nn.Linear(sum(sizes), 4)
    col = ColumnParallelLinear.from_linear(fc1, sizes, rank)
    row = RowParallelLinear.from_linear(fc2, sizes, rank)
    x = torch.randn(3, 8, requires_grad=True)
    flushes = []  # how many weight gradients were waiting at each flush
    flush = layers._flush_weight_grads

    def spy():
        flushes.append((len(layers._DEFERRED_WGRAD), layers.COMM.calls))
        flush()

    layers._flush_weight_grads = spy
    layers.COMM.reset()
    y = row(torch.relu(col(x)))
    calls_after_forward = layers.COMM.calls
    y.pow(2).sum().backward()
    # the same weight gradient from plain autograd on the full layers, cut to this rank's rows
    (fc2(torch.relu(fc1(x.detach()))).pow(2).sum()).backward()
    o = sum(sizes[:rank])
    return {
        "flushes": flushes,
        "calls_after_forward": calls_after_forward,
        "left_after_backward": len(layers._DEFERRED_WGRAD),
        "w_grad": col.weight.grad,
        "w_grad_ref": fc1.weight.grad[o : o + sizes[rank]],
        "dx": x.grad,
    }
