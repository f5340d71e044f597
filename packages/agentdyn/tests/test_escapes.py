"""Every escape attempt a prompt-injected model made through the coding tool (agentdyn.escapes) must
fail against the sandbox, checked inside (the test code) and outside (the host); run without the
sandbox, the same attempts escape, so these checks can fail."""

import asyncio
import os
import shutil
import socket
import tempfile

import pytest

from agentdyn.escapes import ATTEMPTS, Attempt, EscapeHost, run_attempt, run_attempts
from agentdyn.sandbox import Sandbox, missing_layers

MISSING = missing_layers()
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"this host lacks sandbox layer(s): {MISSING}")
BY_NAME = {a.name: a for a in ATTEMPTS}


@pytest.fixture(scope="module")
def held():
    """One run of every attempt against the strict sandbox: {name: None or what escaped}."""
    return asyncio.run(run_attempts("strict"))


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_escape_attempt_fails(held, name):
    assert held[name] is None, held[name]


def _one(attempts: list[Attempt], **sandbox_kw) -> list[str | None]:
    """``attempts`` against one strict sandbox made with ``sandbox_kw`` (set as attributes when not
    constructor arguments)."""

    async def go():
        with EscapeHost() as host:
            legacy = sandbox_kw.pop("legacy_mounts", False)
            sb = Sandbox(isolation="strict", **sandbox_kw)
            sb.legacy_mounts = legacy
            root = tempfile.mkdtemp(prefix="agentdyn-escapes-")
            try:
                return [await run_attempt(sb, host, a, root) for a in attempts]
            finally:
                await sb.close()
                shutil.rmtree(root, ignore_errors=True)

    return asyncio.run(go())


_VISIBLE = """
def test_escape_sees_outside():
    assert "root-only" in os.listdir(CTX["outside"])  # the target is there, world-writable
"""


@pytest.mark.parametrize("legacy_mounts", [False, True], ids=["mount_setattr", "remount-each"])
def test_a_visible_world_writable_directory_is_still_read_only(legacy_mounts):
    # /tmp not hidden (only /root, which holds this Python, and the work root): only the read-only
    # mounts keep the tool from writing there
    seen, wrote = _one(
        [Attempt("visible", _VISIBLE), BY_NAME["write_outside_workdir"]], hide=("/root",), legacy_mounts=legacy_mounts
    )
    assert seen is None, seen
    assert wrote is None, wrote


_RELAY = """
def test_escape_relay_reaches_only_the_site():
    socket.create_connection(("127.0.0.1", SITE), timeout=10).close()
    for port in CTX["ports"]:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=3).close()
"""


def test_a_tool_with_network_reaches_its_site_and_no_other_port():
    site = socket.create_server(("127.0.0.1", 0))
    try:
        port = site.getsockname()[1]
        code = f"\nSITE = {port}\n" + _RELAY
        (res,) = _one([Attempt("relay", code)], net={"run_tests": [f"http://127.0.0.1:{port}"]})
        assert res is None, res
        site.settimeout(10)
        conn, _ = site.accept()  # the tool's connection arrived, through the relay
        conn.close()
    finally:
        site.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="the unsandboxed run reads the service's /proc as root")
def test_without_the_sandbox_the_same_attempts_escape():
    # only attempts that do no harm when they succeed: the files they write are removed, the
    # processes they leave are killed, and no source is touched, no fork bomb or signal sent
    safe = [
        "write_outside_workdir",
        "read_etc_shadow",
        "read_service_env_secrets",
        "connect_other_loopback_ports",
        "setsid_sleep_outlives_tool",
        "allocate_5_gib",
    ]  # raise_own_rlimits is left out: whether root may raise a hard limit depends on CAP_SYS_RESOURCE
    escaped = asyncio.run(run_attempts("off", [BY_NAME[n] for n in safe]))
    assert [n for n in safe if escaped[n] is None] == []
    assert "outlived their tool" in escaped["setsid_sleep_outlives_tool"]
    assert "files written outside" in escaped["write_outside_workdir"]
