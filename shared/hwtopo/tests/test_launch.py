"""hwtopo.launch: results by rank, the first failure named, nothing left running, loopback only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from hwtopo.launch import RankError, init_from_env, rendezvous_store, restart_count, spawn  # noqa: E402


def _sum_ranks(rank: int, world: int, scale: float) -> dict:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t * scale, "env": [os.environ["RANK"], os.environ["WORLD_SIZE"]]}


def test_results_come_back_by_rank_with_torchrun_environment():
    out = spawn(_sum_ranks, 3, args=(2.0,))
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(torch.equal(o["sum"], torch.tensor([6.0])) for o in out)
    assert [o["env"] for o in out] == [["0", "3"], ["1", "3"], ["2", "3"]]


def _raise_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("bad shard size 7")
    dist.barrier()


def test_a_raising_rank_is_named_not_its_waiting_peers():
    with pytest.raises(RankError, match=r"rank 1 .*failed: ValueError: bad shard size 7") as info:
        spawn(_raise_on_one, 3, pg_timeout_s=20)
    assert info.value.rank == 1


def _killed_on_two(rank: int, world: int) -> None:
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_killed_rank_is_blamed_rather_than_the_survivors():
    with pytest.raises(RankError, match=r"rank 2 .*killed by SIGKILL") as info:
        spawn(_killed_on_two, 3, pg_timeout_s=20)
    assert info.value.rank == 2 and info.value.exitcode == -signal.SIGKILL


def _killed_once(rank: int, world: int, always: bool) -> dict:
    store = rendezvous_store(30)
    if rank == 1 and (always or restart_count() == 0):
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:  # the replacement reaches its peers through the job's store, not the default group
        store.set("replacement", str(os.getpid()))
    else:
        store.wait(["replacement"])
        dist.destroy_process_group()  # its default group lost rank 1 for good
    return {"restarts": restart_count(), "grouped": dist.is_initialized(), "pid": os.getpid()}


def test_a_killed_rank_is_started_again_once_and_meets_its_peers_in_the_store():
    got = spawn(_killed_once, 3, (False,), pg_timeout_s=20, max_restarts=1)
    assert [g["restarts"] for g in got] == [0, 1, 0]
    assert [g["grouped"] for g in got] == [False, False, False]
    assert len({g["pid"] for g in got}) == 3
    # a rank that keeps dying spends the restarts, then is blamed as before
    with pytest.raises(RankError, match=r"rank 1 .*killed by SIGKILL") as info:
        spawn(_killed_once, 3, (True,), pg_timeout_s=20, max_restarts=1)
    assert info.value.rank == 1


class _Opaque:
    pass


def _returns_object(rank: int, world: int):
    return {"ok": _Opaque()}


def test_a_result_that_would_need_pickle_code_is_refused_by_name():
    with pytest.raises(RankError, match=r"result\['ok'\] is a _Opaque"):
        spawn(_returns_object, 1)


def _sleep(rank: int, world: int) -> None:
    time.sleep(60)


def test_a_stalled_rank_times_out_with_its_number():
    with pytest.raises(RankError, match=r"rank\(s\) \[0\] did not finish within 3 s"):
        spawn(_sleep, 1, timeout_s=3, init_group=False)


def _join_yourself(rank: int, world: int) -> int:
    r, w = init_from_env(timeout_s=30)
    return r * 10 + w


def test_fn_written_for_torchrun_joins_through_init_from_env():
    assert spawn(_join_yourself, 2, init_group=False) == [2, 12]


def _listening_inodes() -> list[tuple[str, str]]:
    """(local address hex, inode) of TCP sockets in LISTEN state on this machine."""
    rows = []
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if path.exists():
            for line in path.read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A":
                    rows.append((f[1].split(":")[0], f[9]))
    return rows


def _my_listeners(rank: int, world: int) -> list[str]:
    dist.barrier()
    mine = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    return [addr for addr, inode in _listening_inodes() if inode in mine]


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc/net prints them


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net")
def test_ranks_listen_on_loopback_only():
    for addrs in spawn(_my_listeners, 2):
        assert addrs and set(addrs) <= LOOPBACK, addrs


LAUNCHER = textwrap.dedent(
    """
    import os, sys, time
    from hwtopo.launch import spawn

    def park(rank, world, out):
        open(os.path.join(out, f"pid{rank}"), "w").write(str(os.getpid()))
        time.sleep(600)

    if __name__ == "__main__":
        spawn(park, 2, args=(sys.argv[1],), init_group=False, timeout_s=600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")
def test_ranks_die_with_a_sigkilled_launcher(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("pid*"))) < 2:
            assert time.monotonic() < deadline, "ranks never started"
            assert proc.poll() is None, "launcher exited early"
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if _alive(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert left == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="world must be a positive integer"):
        spawn(_sum_ranks, 0)
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        spawn(_sum_ranks, 1, threads=0)
    with pytest.raises(ValueError, match="max_restarts must be a non-negative integer"):
        spawn(_sum_ranks, 1, max_restarts=-1)
