"""Spawned workers for the pretrained-checkpoint tests (module level so that spawn can import them)."""

import torch

# uneven on both segments: KV groups 3:1, MLP blocks 5:3 of the tiny configs in test_pretrained
ATTN_UNITS, MLP_UNITS = (3, 1), (5, 3)


def fixed_ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(7))


def _full_logits(model, ids):
    from xronos.layers import gather_uneven

    logits = model(input_ids=ids).logits.detach()
    head = model.lm_head
    return gather_uneven(logits, head.sizes, 2) if hasattr(head, "sizes") else logits


def shard_lora_save(rank, world, dirs, out_root):
    """Per family: load this rank's shard of the checkpoint, its loss and logits, a short LoRA
    fine-tune, the logits after it, and the merged checkpoint written to ``out_root/<family>``."""
    import torch.distributed as dist
    from dist_helpers import small_cfg

    from xronos.partition import Partition
    from xronos.pretrained import inspect_checkpoint, load_sharded, model_shape, save_merged
    from xronos.shard import lm_loss
    from xronos.train import TPTrainer

    out = {}
    for family, path in dirs.items():
        ckpt = inspect_checkpoint(path)
        part = Partition(model_shape(ckpt.config, 16), ATTN_UNITS, MLP_UNITS)
        model, stats = load_sharded(ckpt, part, rank, None, vocab_parallel="head")
        held = sum(p.numel() for p in model.parameters())  # counted on the model, apart from the loader
        ids = fixed_ids()
        with torch.no_grad():
            loss = lm_loss(model, model(input_ids=ids).logits, ids).item()
            before = _full_logits(model, ids)
        cfg = small_cfg(lora_r=4, vocab_parallel="head", lr=1e-2, seq_len=24)
        trainer = TPTrainer(cfg, part, rank, model=model)
        losses = [trainer.step()["loss"] for _ in range(3)]
        with torch.no_grad():
            after = _full_logits(model, ids)
        saved = save_merged(model, f"{out_root}/{family}", rank=rank)
        dist.barrier()  # the test reads rank 0's directory once every rank is done
        out[family] = {
            "loss": loss,
            "before": before,
            "after": after,
            "losses": losses,
            "reads": stats.reads,
            "bytes_read": stats.bytes_read,
            "params_held": stats.params_held,
            "model_params": held,
            "saved": None if saved is None else str(saved),
            "shapes": {n: tuple(p.shape) for n, p in model.named_parameters() if "lora_" not in n},
        }
    return out
