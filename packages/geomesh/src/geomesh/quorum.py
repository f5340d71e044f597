"""Carry on without a lost worker: the survivors agree on who is left and form a new group.

When a worker dies (its sockets close) or stalls past the group's timeout, the collective every
other worker is blocked in fails. Each survivor then announces itself in the rendezvous store under
a new epoch, waits ``grace_s`` for the others (a survivor still in its inner phase reaches the
failed collective later), and proposes the set it saw; the first proposal written wins
(``compare_set``), so every survivor adopts the same members. They form a new gloo group of those
ranks only (``use_local_synchronization``: the lost rank takes no part) and go on from the outer
state they share, which is identical on all of them.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["Quorum"]

log = logging.getLogger(__name__)


class Quorum:
    """Membership of the outer loop across worker losses (global ranks of the default group)."""

    def __init__(self, grace_s: float = 2.0, timeout_s: float = 60.0):
        if not 0 < grace_s <= 600 or not 0 < timeout_s <= 3600:
            raise ValueError(f"grace_s ({grace_s!r}) must be in (0, 600] and timeout_s ({timeout_s!r}) in (0, 3600]")
        self.grace_s = grace_s
        self.timeout_s = timeout_s
        self.epoch = 0
        self.members: list[int] = list(range(dist.get_world_size())) if dist.is_initialized() else [0]
        self.lost: list[int] = []

    def reform(self) -> dist.ProcessGroup:
        """Agree with the other survivors on the members left and return a group of them."""
        from .diloco import GeoMeshError  # (diloco imports this module)

        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        self.epoch += 1
        prefix = f"geomesh-quorum/{self.epoch}/"
        store.set(f"{prefix}alive/{me}", "1")
        time.sleep(self.grace_s)
        seen = [r for r in self.members if store.check([f"{prefix}alive/{r}"])]
        # the first proposal stands: every survivor reads back the same list
        proposal = ",".join(map(str, seen))
        agreed = store.compare_set(f"{prefix}members", "", proposal)
        members = [int(x) for x in agreed.decode().split(",")]
        if me not in members:
            raise GeoMeshError(f"rank {me} reached the quorum of epoch {self.epoch} too late (members: {members})")
        self.lost += [r for r in self.members if r not in members]
        self.members = members
        log.warning("quorum epoch %d: members %s, lost %s", self.epoch, members, self.lost)
        timeout = timedelta(seconds=self.timeout_s)
        return dist.new_group(ranks=members, use_local_synchronization=True, timeout=timeout)
