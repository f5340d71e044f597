"""Spawned workers for the checkpoint tests: xronos train's worker with a fault injected into one
rank's checkpoint write (module level so that spawn can import them)."""

import os

from dist_helpers import small_cfg


def train_with_fault(rank, world, ckpt_dir, steps, fail_step, how):
    """``finetune_rank`` (even TP, a checkpoint every 2 steps); rank 1's write of step ``fail_step``
    either kills the process before writing ("kill") or fails with a full disk ("enospc")."""
    from xronos.runner import finetune_rank
    from xronos.train import TPTrainer

    if rank == 1 and fail_step is not None:
        save = TPTrainer.save

        def faulty(self, directory):
            if self.step_idx == fail_step:
                if how == "kill":
                    os._exit(17)
                raise OSError(28, "No space left on device")
            return save(self, directory)

        TPTrainer.save = faulty
    return finetune_rank(rank, world, small_cfg(steps=steps).to_dict(), "tp", ckpt_dir, 2, None, None)
