"""The bench's result as JSON and as a table: per-seed headline numbers, their medians and spread."""

from __future__ import annotations

import statistics
from dataclasses import asdict

import hwtopo

from . import __version__

__all__ = ["HEADLINE_KEYS", "headline", "aggregate", "bench_json", "table", "chain_text"]

HEADLINE_KEYS = tuple(
    "ttp_ratio_vs_best_static gap_to_oracle switches switch_overhead_frac gns_overhead_frac decision_eval_frac".split()
)
# what every seed's summary keeps of a run, of its chain links and of its decisions
_PER_SEED = """time_to_target_s first_eval_at_target_s final_val_ppl steps samples clock_s switch_s gns_s decision_eval_s
    decision_eval_frac decision_s""".split()
_LINK = "clock samples strategy switch switch_s branches compared_at".split()
_DECISION = "elapsed_s current chosen switched noise_scale noise_range pairs remaining_s reason".split()


def headline(runs: dict, cfg, seed: int | None = None) -> tuple[dict, list[str]]:
    """Headline numbers of one seed and the notes that qualify them. A variant that missed the target is censored
    at the budget and named in ``head["censored"]``: the seed stays in the headline, flagged."""
    notes = []
    ttt = {k: r["time_to_target_s"] for k, r in runs.items()}
    for k, t in ttt.items():
        if t is None:
            notes.append(
                f"{'' if seed is None else f'seed {seed}: '}{k} did not reach the target perplexity "
                f"{cfg.target_ppl:g} (by the mean of its last {cfg.target_window} evaluations) within the "
                f"{cfg.budget_s:g}s budget (last evaluation: perplexity {runs[k]['final_val_ppl']:.2f}); its time to "
                f"target is censored at the budget"
            )
    cona = runs["cona"]
    cen = {k: (t if t is not None else cfg.budget_s) for k, t in ttt.items()}
    c, bs, o = cen["cona"], cen["best_static"], cen.get("oracle")
    head = {
        "ttp_ratio_vs_best_static": c / bs,
        "gap_to_oracle": (c - o) / o if o else None,
        "switches": max(len(cona["chain"]) - 1, 0),
        "switch_overhead_frac": cona["switch_s"] / cona["clock_s"] if cona["clock_s"] else 0.0,
        "gns_overhead_frac": cona["gns_s"] / cona["clock_s"] if cona["clock_s"] else 0.0,
        "decision_eval_frac": cona.get("decision_eval_frac", 0.0),
        "censored": sorted(k for k, t in ttt.items() if t is None),
    }
    return head, notes


def aggregate(per_seed: dict) -> tuple[dict, dict]:
    """Median over seeds of each headline number and its spread; ``censored_seeds``: ``"seed: variant"`` for every
    variant censored at the budget (in the median, as censored times)."""
    head, spread = {}, {}
    for k in HEADLINE_KEYS:
        vals = [h.get(k) for h in per_seed.values()]
        ok = [v for v in vals if v is not None]
        med = statistics.median(ok) if ok else None
        if k == "switches" and med is not None:
            med = float(med) if med != int(med) else int(med)
        head[k] = med
        spread[k] = {
            "median": med,
            "min": min(ok) if ok else None,
            "max": max(ok) if ok else None,
            "per_seed": vals,
            "seeds_without_value": len(vals) - len(ok),
        }
    head["censored_seeds"] = [f"{seed}: {k}" for seed, h in per_seed.items() for k in h.get("censored", [])]
    return head, spread


def _brief(d: dict) -> dict:
    """One decision, short (every seed's log in the JSON, not only the first seed's)."""
    top = [
        [e["strategy"], round(e["throughput"]), round(e["efficiency"], 3), round(e["goodput"])]
        for e in d.get("ranking", [])[:4]
    ]
    return {k: d[k] for k in _DECISION if k in d} | {"top": top}


def _seed_summary(run: dict) -> dict:
    return {k: run[k] for k in _PER_SEED} | {
        "strategies": [c["strategy"] for c in run["chain"]],
        "chain": [{k: c[k] for k in _LINK if k in c} for c in run["chain"]],
        "decisions": [_brief(d) for d in run["decisions"][:40]],
        "decisions_total": len(run["decisions"]),
    }


def _results(seeds: dict, budget_s: float) -> dict:
    """Per variant: the first seed's run in full (its first 40 decisions), then every seed's summary; the median
    time to target counts a seed that missed the target at the budget (``censored_seeds``)."""
    first = next(iter(seeds.values()))["runs"]
    out = {}
    for k, r in first.items():
        ttts = [s["runs"][k]["time_to_target_s"] for s in seeds.values()]
        out[k] = {kk: vv for kk, vv in r.items() if kk != "decisions"} | {
            "decisions": r["decisions"][:40],
            "decisions_total": len(r["decisions"]),
            "time_to_target_s_median": statistics.median([budget_s if t is None else t for t in ttts]),
            "censored_seeds": [seed for seed, t in zip(seeds, ttts) if t is None],
            "per_seed": {seed: _seed_summary(s["runs"][k]) for seed, s in seeds.items()},
        }
    return out


def bench_json(out: dict, cfg, quick: bool, wall_s: float) -> dict:
    """The bench's JSON from ``bench_worker``'s result."""
    per_seed, notes = {}, []
    for seed, r in out["seeds"].items():
        per_seed[seed], n = headline(r["runs"], cfg, seed)
        notes += n
    head, spread = aggregate(per_seed)
    first = next(iter(out["seeds"].values()))
    head["oracle_branches"] = len(first["step0"].get("oracle_branches", []))
    cores = hwtopo.probe().cores
    oversub = cfg.world > cores
    shared = " (oversubscribed: ranks time-share cores, so step times include waiting for a core)"
    notes.append(f"{cfg.world} ranks on {cores} cores" + (shared if oversub else ""))
    notes.append("variants of a seed run interleaved in short slices, so they share the machine's load")
    config = asdict(cfg) | {
        "quick": quick,
        "wall_s": wall_s,
        "model": "LlamaForCausalLM (tiny, random init)",
        "data": "Python stdlib sources, byte-level",
        "clock": "training wall time on rank 0, validation excluded",
        "oversubscribed": oversub,
        "seed_list": cfg.seed_list,
    }
    return {
        "package": "cona",
        "version": __version__,
        "config": config,
        "machine": hwtopo.to_dict(hwtopo.probe_cluster()),
        "results": _results(out["seeds"], cfg.budget_s),
        "oracle_branches": first["step0"].get("oracle_branches", []),
        "probe": out["probe"] | {"throughput": out["throughput"]},
        "step0": {seed: r["step0"] for seed, r in out["seeds"].items()},
        "headline": head,
        "headline_spread": spread,
        "notes": notes,
        "emulated": False,
    }


def _fmt(v) -> str:
    return "n/a" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def table(res: dict) -> str:
    """The bench JSON as markdown: one row per variant, then the headline with its spread over seeds."""
    seeds = res["config"]["seed_list"]
    rows = [
        f"| variant | time to target (s), median of {len(seeds)} seeds | per seed | final ppl (seed {seeds[0]}) | "
        f"steps | samples | switches | strategies (seed {seeds[0]}) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, r in res["results"].items():
        t = r["time_to_target_s_median"]
        cen = f" ({len(r['censored_seeds'])} censored at the budget)" if r["censored_seeds"] else ""
        per = ", ".join(
            "-" if p["time_to_target_s"] is None else f"{p['time_to_target_s']:.1f}" for p in r["per_seed"].values()
        )
        strat = " -> ".join(c["strategy"] for c in r["chain"])
        rows.append(
            f"| {k} | {'not reached' if t is None else f'{t:.1f}'}{cen} | {per} | {r['final_val_ppl']:.2f} | {r['steps']} "
            f"| {r['samples']} | {max(len(r['chain']) - 1, 0)} | {strat} |"
        )
    w, every = res["config"].get("target_window", 1), res["config"]["eval_every_s"]
    rows.append(
        f"\ntime to target: the first validation evaluation (every {every:g} s of training clock) at which the mean "
        f"of the last {w} is at or below the target"
    )
    sp = res["headline_spread"]
    head = [
        f"| `{k}` | {_fmt(v)} | {_fmt(sp[k]['min'])} .. {_fmt(sp[k]['max'])} | "
        f"{', '.join(_fmt(x) for x in sp[k]['per_seed'])} |"
        for k, v in res["headline"].items()
        if k in sp
    ]
    cs = res["headline"].get("censored_seeds")
    rows += ["", "| headline (median over seeds) | value | min .. max | per seed |", "|---|---|---|---|", *head]
    rows += ["", f"censored at the budget (in the medians, flagged): {', '.join(cs) if cs else 'none'}"]
    return "\n".join(rows) + "\n"


def chain_text(res: dict) -> str:
    """cona's chain of the first seed, one line per strategy it ran, with the reason."""
    return "\n".join(f"- t={c['clock']:.1f}s {c['strategy']}: {c['why']}" for c in res["results"]["cona"]["chain"])
