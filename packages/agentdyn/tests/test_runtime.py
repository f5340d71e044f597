"""The agent runtime end to end: each task type through the LLM emulator and real sandboxed tools,
timelines and usage, the policies (native, static limit, CPU-aware), and the bench pipeline."""

import asyncio

import pytest

from agentdyn.bench import WorkloadConfig, bench
from agentdyn.emulator import EmulatorConfig
from agentdyn.escapes import ATTEMPTS
from agentdyn.runtime import AgentRequest, Harness, RequestError, validate_request
from agentdyn.sandbox import missing_layers, zombie_children
from agentdyn.scheduler import StaticLimitPolicy, make_policy

FAST = EmulatorConfig(ttft_s=0.05, ttft_sigma=0.0, tokens_per_s=2000, tps_sigma=0.0)


def test_validate_request():
    r = validate_request({"task_type": "coding", "input": {"work": 300}, "max_steps": 5})
    assert r.task_type == "coding" and r.max_steps == 5
    with pytest.raises(RequestError) as e:
        validate_request({"task_type": "coding", "max_steps": 0})
    assert e.value.field == "max_steps" and e.value.status == 400
    with pytest.raises(RequestError) as e:
        validate_request({"task_type": "dance"})
    assert e.value.status == 422


@pytest.mark.slow
def test_each_task_type_end_to_end_with_timeline():
    async def go():
        async with Harness(emulator=FAST, site_pages=40) as h:
            return [
                await h.run("rag_qa", {"question": "json decoder error", "shard": 1, "shards": 16}),
                await h.run("web_search", {"query": "socket timeout", "pages": 4}),
                await h.run("coding", {"work": 500}),
            ]

    rag, web, code = asyncio.run(go())
    for r in (rag, web, code):
        assert r.ok, r.error
        phases = [e["phase"] for e in r.timeline]
        assert phases[0] == "llm" and phases[-1] == "llm" and "tool" in phases
        assert all(e["end"] >= e["start"] >= 0 for e in r.timeline)
        assert r.usage.tools.cpu_s > 0 and r.usage.llm_wait_s > 0
        assert r.latency_s >= r.usage.llm_wait_s
    assert [e["tool"] for e in rag.timeline if e["phase"] == "tool"] == ["rag_index", "rag_query", "rag_query"]
    assert "rag_query" in rag.answer or "hits" in rag.answer
    assert code.usage.tool_calls == 5 and '"passed": 11' in code.answer
    assert web.usage.tools.peak_rss_bytes > 1 << 20
    assert zombie_children() == []


def test_unknown_tool_from_the_model_is_an_error_result_not_a_crash():
    async def go():
        async with Harness(emulator=FAST, site_pages=20) as h:
            # a model that asks for a tool the task does not have
            async def chat(messages, tools=None, **kw):
                n = sum(1 for m in messages if m["role"] == "assistant")
                if n == 0:
                    return {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "rm_rf", "arguments": "{}"}}
                        ],
                    }, {"attempts": 1}
                return {"role": "assistant", "content": messages[-1]["content"]}, {"attempts": 1}

            h.runtime.llm.chat = chat
            return await h.run("coding", {})

    r = asyncio.run(go())
    assert r.ok and "not available" in r.answer


def test_max_steps_bounds_the_loop():
    async def go():
        async with Harness(emulator=FAST, site_pages=20) as h:
            return await h.runtime.run(AgentRequest("rag_qa", {"shard": 1, "shards": 16}, max_steps=1))

    r = asyncio.run(go())
    assert not r.ok and r.error.startswith("max_steps")


def test_static_limit_policy_queues_requests():
    pol = StaticLimitPolicy(cores=2)
    assert pol.workers == 1
    assert StaticLimitPolicy(cores=8).workers == 6

    async def go():
        async with Harness(emulator=FAST, site_pages=20, policy=pol) as h:
            return await asyncio.gather(*(h.run("web_search", {"searches": 0}) for _ in range(3)))

    res = asyncio.run(go())
    assert all(r.ok for r in res)
    assert sum(1 for r in res if any(e["phase"] == "queue" for e in r.timeline)) >= 1


def test_optimized_policy_needs_profiles():
    with pytest.raises(ValueError, match="calibration"):
        make_policy("optimized", [0, 1])
    with pytest.raises(ValueError, match="policy must be one of"):
        make_policy("fast", [0, 1])


@pytest.mark.slow
def test_bench_pipeline_reports_headline_keys():
    cfg = WorkloadConfig(
        per_type=1,
        coding_work=300,
        rag_shards=16,
        web_pages=2,
        emulator=FAST,
        arrival_window_s=0.1,
        types=("web_search", "coding"),
        seeds=(101,),
        loads=(("fit", 0.8), ("oversubscribed", 2.0)),
    )
    out = asyncio.run(bench(cfg, service=True))
    h = out["headline"]
    for k in (
        "cpu_task_latency_ratio_vs_fair",
        "mixed_avg_latency_reduction_vs_fair",
        "cpu_task_latency_ratio_vs_fair_fit",
        "mixed_avg_latency_reduction_vs_fair_fit",
    ):
        assert isinstance(h[k], float)
        lo, hi = h["seed_spread"][k]
        assert lo == hi == h[k]  # one seed: its own figure
    assert h["requests_failed"] == 0 and h["zombie_processes"] == 0
    assert h["heldout_seeds"] == [101] and out["seeds"] == [101]
    # the real service answered every request (malformed ones with a message) and left nothing
    assert h["requests_lost"] == 0 and h["service_leftovers"] == 0
    svc = out["service"]
    assert svc["requests"] == 2 * 2 and svc["sigterm_exit_code"] == 0
    # SIGTERM came once every valid request was in: none was lost, a later one was refused (503)
    # or, when the drain had already ended, found the service closed -- never served
    assert svc["sent_after_sigterm"]["status"] in (503, None)
    # every escape attempt was made against the sandbox and failed (None: the host lacks a layer)
    if missing_layers():
        assert h["sandbox_escapes"] is None and out["sandbox"]["missing"] == missing_layers()
    else:
        assert h["sandbox_escapes"] == 0 and len(out["sandbox"]["escape_attempts"]) == len(ATTEMPTS)
    assert h["cpu_task"] == "coding"
    assert set(out["results"]) == {"fit", "oversubscribed"}
    for load, res in out["results"].items():
        assert set(res) == {"fair", "fair_semaphore", "cgroup_split", "optimized"}
        assert h["best_fair_baseline"][load]["cpu_task"] in ("fair", "fair_semaphore", "cgroup_split")
        nat = res["fair"]
        assert abs(nat["cpu_task_mean_latency_s"] - nat["per_type"]["coding"]["mean_latency_s"]) < 1e-9
    # the rounds rotate the variants, so none always runs first
    firsts = [o.split("/")[2] for o in out["order"][::4]]
    assert firsts == ["fair", "fair_semaphore"]
    # the CPU-aware policy learned its thresholds from the calibration's profiles
    prof = out["profiles"]["tools"]
    assert prof["coding/run_tests"]["cpu_intensity"] > prof["web_search/web_search"]["cpu_intensity"]
    opt = out["results"]["fit"]["optimized"]["policy"]
    assert opt["admission"]["source"] == "learned"
    # every tool call (5 coding + 2 web) was admitted and placed in its tool's weighted group
    assert opt["admission_stats"]["admitted"] == 7
    assert opt["allocation"]["plan"]["classes"]["coding"]["kind"] == "cpu"
    assert sum(opt["runs_by_group"].values()) == 7
    assert opt["tool_shares"]["coding/run_tests"] < opt["tool_shares"]["web_search/web_search"]
    assert isinstance(h["host_quiet"], bool) and out["host"]["quiet"] == h["host_quiet"]
    # the fair baselines' tools were told the thread counts the CPU-aware plan gives each class
    plan = {t: c["threads"] for t, c in opt["allocation"]["plan"]["classes"].items()}
    for v in ("fair", "fair_semaphore", "cgroup_split"):
        pol = out["results"]["fit"][v]["policy"]
        assert pol["threads"] == plan
        assert {t: g["threads"] for t, g in pol["groups"].items()} == plan
    sem = out["results"]["oversubscribed"]["fair_semaphore"]["policy"]
    assert 1 <= sem["max_tool_calls_in_flight"] <= sem["workers"]
