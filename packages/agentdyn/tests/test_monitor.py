"""The resource monitor: PSI parsing, sampler, per-process and per-tool usage."""

import asyncio
import os
import subprocess
import sys
import time

from agentdyn.monitor import SystemSampler, Usage, proc_usage, psi_available, read_loadavg, read_psi
from agentdyn.profiles import ProfileStore
from agentdyn.sandbox import Sandbox


def test_psi_or_loadavg_sampler_gives_fractions():
    la, running, total = read_loadavg()
    assert la >= 0 and running >= 1 and total >= running
    if psi_available():
        p = read_psi("cpu")
        assert "some" in p and "total" in p["some"]
    s = SystemSampler(0.02).start()
    try:
        import time

        time.sleep(0.15)
        snap = s.latest()
    finally:
        s.stop()
    assert 0.0 <= snap.cpu_some <= 1.0 and 0.0 <= snap.io_some <= 1.0
    assert snap.source == ("psi" if psi_available() else "loadavg")
    ov = s.overhead()
    assert ov["samples"] >= 2 and ov["cpu_s_per_sample"] > 0
    assert s.summary()["samples"] >= 1


def test_usage_intensity_discounts_run_queue_wait():
    u = Usage(cpu_s=1.0, wall_s=4.0, run_wait_s=2.0)
    assert abs(u.cpu_intensity - 0.5) < 1e-9  # 1 s CPU over 2 s uncontended
    v = Usage(cpu_s=1.0, wall_s=1.0, read_bytes=5, peak_rss_bytes=10)
    v.add(Usage(cpu_s=2.0, wall_s=1.0, read_bytes=1, peak_rss_bytes=3))
    assert v.cpu_s == 3.0 and v.read_bytes == 6 and v.peak_rss_bytes == 10


def test_proc_usage_of_a_live_process():
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass\nprint('burnt', flush=True)\n"
            "time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == "burnt"  # its 0.3 s of CPU are spent, however loaded the machine
        u = proc_usage([p.pid])
    finally:
        p.kill()
        p.wait()
    # /proc counts utime and stime in whole clock ticks, each truncated: up to two ticks under process_time's 0.3 s
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    assert u.cpu_s >= 0.3 - 2 * tick and u.peak_rss_bytes > 1 << 20


def test_tool_usage_cpu_memory_and_disk(tmp_path):
    async def go():
        sb = Sandbox()
        burn = await sb.run("burn", {"cpu_s": 0.3, "alloc_mb": 120}, str(tmp_path / "b"))
        sleep = await sb.run("sleep", {"seconds": 0.3}, str(tmp_path / "s"))
        index = await sb.run("rag_index", {"shard": 1, "shards": 16}, str(tmp_path / "r"))
        return burn, sleep, index

    burn, sleep, index = asyncio.run(go())
    assert burn.ok and sleep.ok and index.ok, (burn.error, sleep.error, index.error)
    assert burn.usage.cpu_s >= 0.3
    assert burn.usage.peak_rss_bytes >= 120 << 20
    assert sleep.usage.cpu_s < sleep.usage.wall_s and sleep.usage.wall_s >= 0.3
    assert burn.usage.cpu_intensity > sleep.usage.cpu_intensity
    # the index file is written and fsync'd: the bytes reach the block layer
    written = os.path.getsize(next((tmp_path / "r").glob("rag-index-*.json")))
    assert index.usage.write_bytes >= written * 0.9


def test_profiles_learn_and_roundtrip(tmp_path):
    st = ProfileStore()
    st.observe("coding", "run_tests", Usage(cpu_s=1.0, wall_s=3.0, run_wait_s=2.0), alone=True, pressure=0.5)
    st.observe_request("coding")
    p = st.get("coding", "run_tests")
    assert abs(p.cpu_intensity - 1.0) < 1e-9  # contention removed
    st.save(tmp_path / "p.json")
    st2 = ProfileStore.load(tmp_path / "p.json")
    assert st2.to_dict() == st.to_dict()
    assert st2.classes()["coding"]["cpu_s"] == 1.0


def test_group_pids_and_usage_match_procfs(tmp_path):
    # a sleeping group (a shell and its child): psutil's numbers must be procfs's own, to the tick and byte
    from agentdyn.monitor import _read_hwm, group_pids

    p = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True)
    try:
        for _ in range(200):
            pids = group_pids(p.pid)
            if len(pids) == 2:
                break
            time.sleep(0.01)
        assert p.pid in pids and len(pids) == 2
        tick = os.sysconf("SC_CLK_TCK")

        def procfs():  # (cpu seconds, peak rss) read straight from procfs
            cpu, rss = 0.0, 0
            for pid in pids:
                rest = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # rest[0] is field 3
                cpu += sum(int(x) for x in rest[11:15]) / tick  # fields 14-17: utime stime cutime cstime
                status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
                rss += int(status["VmRSS"].split()[0]) * 1024  # exact; stat's field 24 lags per-CPU batches
            return cpu, max(rss, max(_read_hwm(pid) for pid in pids))

        # the child may still be between fork and exec: compare only a reading that held still around the call
        for _ in range(200):
            before = procfs()
            u = proc_usage(pids)
            if procfs() == before:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the group's procfs numbers never held still")
        assert abs(u.cpu_s - before[0]) < 1e-9
        assert u.peak_rss_bytes == before[1]
    finally:
        os.killpg(p.pid, 9)
        p.wait()
    assert p.pid not in group_pids(p.pid)  # reaped (the orphaned sleep waits for init to reap it)
