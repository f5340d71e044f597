"""Agents on a local DLM: agentdyn agents use `bicache serve` as their OpenAI-compatible LLM endpoint.

A user saves a (random-init, tiny) bicache diffusion LM, serves it with the `bicache serve` CLI, and
points agentdyn's LLM client and agent runtime at its `/v1` base URL.
"""

import asyncio
import os
import subprocess
import sys
import time
import urllib.request

import pytest

import agentdyn
import bicache
from hwtopo.launch import free_port


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"bicache serve exited with code {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"bicache serve did not answer on {url}/health within {timeout_s:.0f}s")


@pytest.fixture
def bicache_endpoint(tmp_path):
    ckpt = bicache.DiffusionLM.random(seed=0, layers=2, hidden=32, heads=2).save(tmp_path / "dlm")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "bicache", "serve", "--checkpoint", str(ckpt), "--mode", "none",
           "--port", str(port), "--quiet"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc)
        yield base + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_agentdyn_agents_use_bicache_serve(bicache_endpoint):
    llm = agentdyn.LLMConfig(base_url=bicache_endpoint, model="bicache-tiny-dlm", timeout_s=60, retries=0)

    async def scenario():
        # 1. agentdyn's OpenAI client talks to bicache's chat route (a prompt in the DLM's vocabulary)
        client = agentdyn.LLMClient(llm)
        try:
            msg, info = await client.chat([{"role": "user", "content": "k01 1 2 3 k02 4 5 6 ? k02"}])
        finally:
            await client.close()
        # 2. a real agent request (system prompt + JSON task input, tool schemas) through the runtime
        runtime = agentdyn.Runtime(llm, tool_timeout_s=60)
        try:
            result = await runtime.run(agentdyn.AgentRequest("rag_qa", {"question": "json decoder error"}, max_steps=2))
        finally:
            await runtime.close()
        return msg, info, result

    msg, info, result = asyncio.run(scenario())
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert info["usage"]["completion_tokens"] > 0
    assert result.timeline and result.timeline[0]["phase"] == "llm"
    assert result.ok, result.error
    assert isinstance(result.answer, str)
