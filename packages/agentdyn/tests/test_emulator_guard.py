"""The LLM emulator's HTTP surface: malformed requests get 4xx answers, never a 500 or a traceback."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from agentdyn.emulator import EmulatorConfig, LLMEmulator
from hwtopo.testing import Answer, assert_client_errors, malformed_json, send_requests

FAST = EmulatorConfig(ttft_s=0.0, ttft_sigma=0.0, tokens_per_s=1e6, tps_sigma=0.0)
GOOD = {"messages": [{"role": "system", "content": "task_type: rag_qa"}, {"role": "user", "content": "{}"}]}


def _user(content) -> dict:
    return {"messages": [{"role": "system", "content": "task_type: rag_qa"}, {"role": "user", "content": content}]}


CHAT_BODIES = malformed_json("messages") + [
    b'"text"',
    b"\xff\xfe",
    b'{"messages": []}',
    b'{"messages": "hi"}',
    b'{"messages": [1, 2]}',
    b'{"messages": [null]}',
    b'{"messages": [[]]}',
    json.dumps(_user('{"shard": "x"}')).encode(),
    json.dumps(_user('{"shards": [1]}')).encode(),
]
MALFORMED: list[tuple[str, str, bytes]] = [("POST", "/v1/chat/completions", b) for b in CHAT_BODIES] + [
    ("GET", "/v1/chat/completions", b""),
    ("PUT", "/v1/models", b"{}"),
    ("POST", "/v1/nothing", b"{}"),
    ("GET", "/../../etc/passwd", b""),
]


async def _answers(emu: LLMEmulator, requests, headers=None) -> list[Answer]:
    url = (await emu.start()).rsplit("/v1", 1)[0]
    try:
        async with aiohttp.ClientSession() as s:
            return await send_requests(s, [(m, p, b, headers or {}) for m, p, b in requests], url)
    finally:
        await emu.stop()


# Odd but answerable: content as a list of parts (as OpenAI allows), a question of another type.
ODD = [_user(["a", "list"]), _user('{"question": 5}'), _user("not json at all")]


def test_odd_inputs_are_answered_not_crashed_on():
    requests = [("POST", "/v1/chat/completions", json.dumps(b).encode()) for b in ODD]
    for a in asyncio.run(_answers(LLMEmulator(FAST), requests)):
        assert a.status < 500 and "Traceback" not in a.text, (a.status, a.text[:200])


def test_malformed_requests_get_client_errors_without_tracebacks():
    assert_client_errors(asyncio.run(_answers(LLMEmulator(FAST), MALFORMED)))
    good = [("POST", "/v1/chat/completions", json.dumps(GOOD).encode())]
    assert asyncio.run(_answers(LLMEmulator(FAST), good))[0].status == 200


@pytest.mark.parametrize("header, status", [(None, 401), ("Bearer wrong", 401), ("Bearer s3cret", 200)])
def test_token_is_required_when_set(header, status):
    headers = {"Authorization": header} if header else {}
    req = [("POST", "/v1/chat/completions", json.dumps(GOOD).encode())]
    got = asyncio.run(_answers(LLMEmulator(FAST, token="s3cret"), req, headers))[0].status
    assert got == status


def test_cli_refuses_a_public_host_without_a_token(capsys, monkeypatch):
    from agentdyn.cli import main

    monkeypatch.delenv("AGENTDYN_TOKEN", raising=False)
    assert main(["llm-emulator", "--host", "0.0.0.0"]) == 2
    assert "--token" in capsys.readouterr().err
