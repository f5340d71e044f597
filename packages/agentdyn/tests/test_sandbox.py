"""Sandbox: layers probed and required, an unprivileged user in its own namespaces, rlimits, timeouts
that kill everything a tool started, no zombies, an allow-listed environment."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from agentdyn import sandbox as sandbox_mod
from agentdyn.escapes import leftover_processes
from agentdyn.monitor import group_pids
from agentdyn.sandbox import (
    UID_BASE,
    UID_POOL,
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    missing_layers,
    tool_env,
    zombie_children,
)

MISSING = missing_layers()
needs_jail = pytest.mark.skipif(bool(MISSING), reason=f"this host lacks sandbox layer(s): {MISSING}")
MODES = ["off", pytest.param("strict", marks=needs_jail)]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_off_runs_a_tool_in_its_own_process_group_and_session(tmp_path):
    res = asyncio.run(Sandbox(isolation="off").run("whereami", {}, str(tmp_path)))
    assert res.ok, res.error
    assert res.output["pgid"] == res.output["pid"] == res.output["sid"]
    assert res.output["pgid"] != os.getpgid(0)


@needs_jail
def test_strict_runs_a_tool_as_its_own_user_in_its_own_namespaces(tmp_path):
    async def go():
        sb = Sandbox(isolation="strict")
        work = sb.workdir(str(tmp_path))
        res = await sb.run("whereami", {}, work)
        return sb, work, res

    sb, work, res = asyncio.run(go())
    assert res.ok, res.error
    out = res.output
    assert UID_BASE <= out["uid"] < UID_BASE + UID_POOL and out["gid"] == out["uid"]
    assert os.stat(work).st_uid == out["uid"] and os.stat(work).st_mode & 0o777 == 0o700
    assert out["pid"] == 1 and out["hostname"] == "agentdyn-tool" != os.uname().nodename
    mine = [line for line in out["cgroups"] if "agentdyn-whereami" in line]
    assert {line.split(":")[1] for line in mine} >= {"memory", "pids"}  # its own group, with both limits
    assert sb.describe()["missing"] == {} and "read-only filesystem" in sb.describe()["layers"]


@pytest.mark.parametrize("isolation", MODES)
def test_hung_tool_is_killed_with_everything_it_started(tmp_path, isolation):
    async def go():
        sb = Sandbox(isolation=isolation)
        lim = SandboxLimits(timeout_s=4)
        return await sb.run("sleep", {"seconds": 60, "children": 2}, str(tmp_path), lim), sb

    res, sb = asyncio.run(go())
    uid = sb.claim(str(tmp_path))  # the uid its tools ran as (None unjailed)
    assert not res.ok and res.killed
    assert "timed out after 4s" in res.error and "every process it started were killed" in res.error
    kids = [int(x) for x in (tmp_path / "children.pids").read_text().split()]
    assert len(kids) == 2
    if isolation == "off":
        assert not any(_alive(k) for k in kids)
    else:  # pids of its own namespace; none of its user's processes is left on the host
        assert leftover_processes((uid,)) == []
    assert not sb.live
    assert zombie_children() == []
    assert res.usage.wall_s >= 4


@pytest.mark.parametrize("isolation", MODES)
def test_cancelled_tool_is_cleaned_up(tmp_path, isolation):
    async def go():
        sb = Sandbox(isolation=isolation)
        task = asyncio.create_task(sb.run("sleep", {"seconds": 60}, str(tmp_path), SandboxLimits(timeout_s=60)))
        await asyncio.sleep(1.0)
        pg = next(iter(sb.live))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return pg, sb

    pg, sb = asyncio.run(go())
    assert [p for p in group_pids(pg) if _alive(p)] == []
    assert zombie_children() == [] and not sb.live
    if isolation == "strict":
        assert leftover_processes((sb.claim(str(tmp_path)),)) == []


@pytest.mark.parametrize("isolation", MODES)
def test_memory_rlimit_stops_a_runaway_tool(tmp_path, isolation):
    lim = SandboxLimits(timeout_s=30, address_space_bytes=600 << 20)
    res = asyncio.run(Sandbox(isolation=isolation).run("burn", {"cpu_s": 0.01, "alloc_mb": 2000}, str(tmp_path), lim))
    assert not res.ok and "memory" in res.error


def test_unknown_tool_and_tool_errors_are_reported(tmp_path):
    async def go():
        sb = Sandbox()
        return (
            await sb.run("no_such_tool", {}, str(tmp_path)),
            await sb.run("rag_query", {"query": ""}, str(tmp_path)),
        )

    a, b = asyncio.run(go())
    assert not a.ok and "unknown tool 'no_such_tool'" in a.error
    assert not b.ok and "args.query" in b.error


def test_killed_tool_still_has_sampled_usage(tmp_path):
    res = asyncio.run(Sandbox().run("burn", {"cpu_s": 30, "alloc_mb": 50}, str(tmp_path), SandboxLimits(timeout_s=3)))
    assert res.killed
    assert res.usage.cpu_s > 0.1  # sampled from /proc (or the cgroup) while it ran
    assert res.usage.peak_rss_bytes >= 50 << 20


def test_tool_env_thread_caps_and_allow_list():
    base = {"PATH": "/bin", "OPENBLAS_NUM_THREADS": "3", "LC_ALL": "C.UTF-8"}
    assert tool_env({"PATH": "/bin"})["OMP_NUM_THREADS"] == "1"  # polite default when unset
    assert tool_env(base)["OPENBLAS_NUM_THREADS"] == "3"  # inherited as is
    free = tool_env(base, "default")
    assert "OPENBLAS_NUM_THREADS" not in free and "OMP_NUM_THREADS" not in free and free["PATH"] == "/bin"
    assert tool_env(base, 2)["MKL_NUM_THREADS"] == "2"
    with pytest.raises(ValueError, match="tool_threads"):
        tool_env(base, 0)
    secrets = {"AGENTDYN_TOKEN": "t", "OPENAI_API_KEY": "k", "AWS_SECRET_ACCESS_KEY": "a", "HOME": "/root"}
    env = tool_env({**base, **secrets})
    assert not set(secrets) & set(env) and env["LC_ALL"] == "C.UTF-8"


def test_default_threads_reach_the_tool(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    res = asyncio.run(Sandbox(tool_threads="default").run("whereami", {}, str(tmp_path)))
    assert res.ok, res.error
    assert res.output["thread_env"]["OMP_NUM_THREADS"] is None


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"memory_bytes": 1000}, "memory_bytes"),
        ({"processes": 0}, "processes"),
        ({"open_files": True}, "open_files"),
        ({"address_space_bytes": 1.5}, "address_space_bytes"),
    ],
)
def test_bad_limits_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SandboxLimits(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"isolation": "maybe"}, "isolation must be one of strict, auto, off"),
        ({"net": {"web_search": ["http://example.com:80"]}}, r"net\['web_search'\]"),
        ({"net": {"web_search": ["https://127.0.0.1:443"]}}, "loopback"),
        ({"net": {"web_search": ["http://127.0.0.1"]}}, "port"),
    ],
)
def test_bad_sandbox_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sandbox(**kwargs)


def test_strict_refuses_a_host_missing_a_layer_and_names_it(monkeypatch):
    monkeypatch.setattr(sandbox_mod, "missing_layers", lambda: {"cgroup pids": "no writable cgroup pids controller"})
    with pytest.raises(SandboxUnavailable, match="cgroup pids") as e:
        Sandbox(isolation="strict")
    assert "--unsafe-no-sandbox" in str(e.value) and e.value.missing == {
        "cgroup pids": "no writable cgroup pids controller"
    }
    sb = Sandbox(isolation="auto")  # runs with what there is; the missing layer is reported
    assert sb.describe()["missing"] == {"cgroup pids": "no writable cgroup pids controller"}
    assert "cgroup pids" not in sb.describe()["layers"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to run as nobody")
def test_an_unprivileged_service_is_told_which_layers_it_lacks():
    code = "from agentdyn.sandbox import missing_layers; import json; print(json.dumps(missing_layers()))"
    p = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert p.returncode == 0, p.stderr
    missing = json.loads(p.stdout)
    assert {"unprivileged user", "pid namespace", "read-only filesystem"} <= set(missing)
    assert "not root" in missing["mount namespace"]


_SERVICE = """
import asyncio, sys
from agentdyn.sandbox import Sandbox, SandboxLimits
asyncio.run(Sandbox(isolation="strict").run("sleep", {"seconds": 300, "children": 2}, sys.argv[1], SandboxLimits(timeout_s=600)))
"""


@needs_jail
def test_a_killed_service_takes_its_tools_with_it(tmp_path):
    work = tmp_path / "w"
    svc = subprocess.Popen([sys.executable, "-c", _SERVICE, str(work)])
    try:
        deadline = time.monotonic() + 60
        while not (work / "children.pids").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (work / "children.pids").exists(), "the tool did not start"
        assert leftover_processes(under=str(tmp_path))  # the tool and its two children run
    finally:
        svc.kill()  # SIGKILL: no cleanup of its own runs
        svc.wait()
    deadline = time.monotonic() + 30
    while leftover_processes(under=str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftover_processes(under=str(tmp_path)) == []
