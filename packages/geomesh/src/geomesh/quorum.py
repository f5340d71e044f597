"""Who takes part in the outer loop: workers that die or stall are dropped, new ones join.

Workers are named by a stable id (their rank in the launch: a replacement for a dead worker takes
its id). The quorum's members always form the default process group, re-made from the rendezvous
store under a new epoch at every change, so a process that never was in the launch's group (a
replacement) can be in the next one.

- Loss: when the collective every member is blocked in fails (a peer's connections closed, or the
  group's timeout passed), each survivor announces itself under the next epoch, waits ``grace_s``
  for the others (a survivor still in its inner phase reaches the failed collective later), and
  proposes the set it saw; the first proposal written wins (``compare_set``), so every survivor
  adopts the same members.
- Join: a new worker asks to join (a key with a fresh nonce) and waits, at most
  ``join_timeout_s``. Members that see a request say so in the next sync's meta exchange; after
  that outer step every member proposes the requests it sees, the first proposal wins, and the
  members and the admitted workers form the next group, where a survivor sends the outer state.

Every wait is bounded: the groups' collectives and connection by ``timeout_s``, a join by
``join_timeout_s``.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch.distributed as dist

from hwtopo import launch as _launch

__all__ = ["Quorum"]

log = logging.getLogger(__name__)
PREFIX = "geomesh-quorum/"


class Quorum:
    """Membership of the outer loop across worker losses and joins (ids are launch ranks).

    ``join=True``: this process replaces a worker (or adds one) and takes part from the next
    outer-step boundary of the running members (``DiLoCo`` then receives their outer state).
    ``store``: the rendezvous store shared by all workers (default: the launch's, see
    ``hwtopo.launch.rendezvous_store``).
    """

    def __init__(
        self,
        grace_s: float = 2.0,
        timeout_s: float = 60.0,
        *,
        join: bool = False,
        join_timeout_s: float = 120.0,
        store: dist.Store | None = None,
    ):
        for name, v, hi in (
            ("grace_s", grace_s, 600),
            ("timeout_s", timeout_s, 3600),
            ("join_timeout_s", join_timeout_s, 3600),
        ):
            if not isinstance(v, (int, float)) or not 0 < v <= hi:
                raise ValueError(f"{name} ({v!r}) must be a number of seconds in (0, {hi}]")
        self.grace_s, self.timeout_s, self.join_timeout_s = float(grace_s), float(timeout_s), float(join_timeout_s)
        self.joining = join
        self.epoch = 0
        started = dist.is_initialized() and not join
        self.me = dist.get_rank() if started else int(os.environ.get("RANK", "0"))
        # the launch's worker count: the ids a join request may carry
        self.world = dist.get_world_size() if started else int(os.environ.get("WORLD_SIZE", "1"))
        self.members: list[int] = list(range(self.world)) if started else [self.me]
        self.lost: list[int] = []
        self.joined: list[int] = []
        self.source = self.members[0]  # the member that sends the outer state to workers that join
        self._store = store
        self._backend = dist.get_backend() if started else _launch.pick_backend()

    @property
    def store(self) -> dist.Store:
        if self._store is None:
            self._store = _launch.rendezvous_store(self.timeout_s)
        return self._store

    def _form(self, members: list[int]) -> None:
        """Make ``members`` the default process group (this epoch's), leaving the previous one."""
        if dist.is_initialized():
            dist.destroy_process_group()
        store = dist.PrefixStore(f"{PREFIX}{self.epoch}/group/", self.store)
        timeout = timedelta(seconds=self.timeout_s)
        dist.init_process_group(
            self._backend, store=store, rank=members.index(self.me), world_size=len(members), timeout=timeout
        )
        self.members = members

    def reform(self) -> None:
        """Agree with the other survivors on the members left and make them the default group."""
        from .diloco import GeoMeshError  # (diloco imports this module)

        for _ in range(len(self.members)):  # a member that vanishes while the group forms: once more
            self.epoch += 1
            prefix = f"{PREFIX}{self.epoch}/"
            self.store.set(f"{prefix}alive/{self.me}", "1")
            time.sleep(self.grace_s)
            seen = [r for r in self.members if self.store.check([f"{prefix}alive/{r}"])]
            # the first proposal stands: every survivor reads back the same list
            agreed = self.store.compare_set(f"{prefix}members", "", ",".join(map(str, seen)))
            members = [int(x) for x in agreed.decode().split(",")]
            if self.me not in members:
                if dist.is_initialized():  # its group went on without it: leave that too
                    dist.destroy_process_group()
                raise GeoMeshError(
                    f"worker {self.me} was dropped from the quorum of epoch {self.epoch} (members: {members}): it "
                    "reached the sync point too late; start it again with Quorum(join=True) to rejoin"
                )
            self.lost += [r for r in self.members if r not in members]
            log.warning("quorum epoch %d: members %s, lost %s", self.epoch, members, self.lost)
            try:
                self._form(members)
                return
            except RuntimeError as e:  # (the connection's timeout passed)
                log.warning("quorum epoch %d did not form (%s); agreeing again", self.epoch, e)
                self.members = members
        raise GeoMeshError(f"worker {self.me}: no quorum formed after {len(self.members)} tries")

    # --- joining --------------------------------------------------------------------------------
    def join_pending(self) -> bool:
        """Whether a worker that is not a member asked to join (said in the sync's meta exchange)."""
        return bool(self._requests())

    def _requests(self) -> list[int]:
        """Ids (launch ranks, or ids past them) of workers that are not members and asked to join."""
        ids = range(max(self.world, max(self.members) + 1))
        return [i for i in ids if i not in self.members and self.store.check([f"{PREFIX}join/{i}"])]

    def admit(self) -> list[int]:
        """At an outer-step boundary, with every member calling: agree on who joins, tell them where
        to go, and form the group with them. Returns the ids admitted (in the new group's order)."""
        self.epoch += 1
        prefix = f"{PREFIX}{self.epoch}/"
        # (a proposal is never empty: compare_set would take an empty value for a missing key)
        proposal = "ids:" + ",".join(map(str, self._requests()))
        agreed = self.store.compare_set(f"{prefix}joiners", "", proposal).decode()
        joiners = [int(x) for x in agreed.removeprefix("ids:").split(",") if x]
        members = sorted(self.members + joiners)
        self.source = self.members[0]
        if joiners and self.me == self.source:  # one member hands each joiner its admission
            for j in joiners:
                nonce = self.store.get(f"{PREFIX}join/{j}").decode()
                self.store.delete_key(f"{PREFIX}join/{j}")
                value = f"{self.epoch};{','.join(map(str, members))};{self.source}"
                self.store.set(f"{PREFIX}admit/{j}/{nonce}", value)
        self.joined += joiners
        log.warning("quorum epoch %d: members %s, joined %s", self.epoch, members, joiners)
        try:
            self._form(members)
        except RuntimeError as e:  # an admitted worker did not come: go on without it
            log.warning("quorum epoch %d did not form with %s (%s)", self.epoch, joiners, e)
            self.members = members
            self.reform()
        return [j for j in joiners if j in self.members]

    def join(self) -> None:
        """Ask to join and wait (at most ``join_timeout_s``) until the members admit this worker."""
        from .diloco import GeoMeshError

        nonce = f"{os.getpid()}-{time.time_ns()}"
        self.store.set(f"{PREFIX}join/{self.me}", nonce)
        key = f"{PREFIX}admit/{self.me}/{nonce}"
        deadline = time.monotonic() + self.join_timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise GeoMeshError(
                    f"worker {self.me} was not admitted within join_timeout_s={self.join_timeout_s:g} s: no "
                    "member reached an outer-step boundary (the run ended, or the members are stalled)"
                )
            time.sleep(0.05)
        epoch, members, source = self.store.get(key).decode().split(";")
        self.epoch, self.source = int(epoch), int(source)
        self._form([int(x) for x in members.split(",")])
        self.joining = False
        log.warning("worker %d joined the quorum of epoch %d: members %s", self.me, self.epoch, self.members)
