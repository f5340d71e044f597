"""The bench's result as JSON and as a table: per-seed headline numbers, their medians and spread."""

from __future__ import annotations

import statistics
from dataclasses import asdict

import hwtopo

from . import __version__
from .harness import time_to_target

__all__ = ["HEADLINE_KEYS", "headline", "aggregate", "bench_json", "table", "chain_text"]

# numeric headline keys: the median over seeds, with the spread beside it in ``headline_spread``
HEADLINE_KEYS = tuple(
    """ttp_ratio_vs_best_baseline oracle_gain_captured oracle_gain_vs_best_baseline ttp_ratio_vs_best_static_hindsight
    ttp_ratio_vs_surrogate_static
    ttp_ratio_vs_goodput_scaling gap_to_oracle switches switch_overhead_frac gns_overhead_frac
    decision_eval_frac""".split()
)
BASELINES = ("best_static_hindsight", "surrogate_static", "goodput_scaling")  # what a user would otherwise run
# what every seed's summary keeps of a run, of its chain links and of its decisions
_PER_SEED = """time_to_target_s first_eval_at_target_s final_val_ppl steps samples clock_s switch_s gns_s decision_eval_s
    decision_eval_frac decision_s stopped_behind""".split()
_LINK = "clock samples strategy switch switch_s branches compared_at".split()
_DECISION = "elapsed_s current chosen switched noise_scale noise_range pairs remaining_s reason".split()


def _censored_note(k: str, run: dict, cfg, seed: int | None) -> str:
    return (
        f"{'' if seed is None else f'seed {seed}: '}{k} did not reach the target perplexity {cfg.target_ppl:g} (by the "
        f"mean of its last {cfg.target_window} evaluations) within the {cfg.budget_s:g}s budget (last evaluation: "
        f"perplexity {run['final_val_ppl']:.2f}); its time to target is censored at the budget"
    )


def headline(runs: dict, cfg, seed: int | None = None) -> tuple[dict, list[str]]:
    """Headline numbers of one seed and the notes that qualify them. A variant that missed the target is censored
    at the budget and named in ``head["censored"]``: the seed stays in the headline, flagged. A static run stopped
    behind another static (``stopped_behind``) is out of the running for the best static, not censored."""
    ttt = {k: r["time_to_target_s"] for k, r in runs.items()}
    live = {k: t for k, t in ttt.items() if not runs[k].get("stopped_behind")}
    notes = [_censored_note(k, runs[k], cfg, seed) for k, t in live.items() if t is None]
    cen = {k: (t if t is not None else cfg.budget_s) for k, t in live.items()}
    statics = {k: t for k, t in cen.items() if k.startswith("static_")}
    hindsight = min(statics, key=lambda k: (statics[k], k))
    base = {"best_static_hindsight": statics[hindsight], "surrogate_static": cen["surrogate_static"]}
    base["goodput_scaling"] = cen["goodput_scaling"]
    best = min(BASELINES, key=lambda k: base[k])
    cona, b, c, o = runs["cona"], base[best], cen["cona"], cen.get("oracle")
    head = {
        "ttp_ratio_vs_best_baseline": c / b,
        "oracle_gain_captured": (b - c) / (b - o) if o is not None and b > o else None,  # None: no oracle gain
        "oracle_gain_vs_best_baseline": (b - o) / b if o is not None else None,  # the room switching has at all
        "ttp_ratio_vs_best_static_hindsight": c / base["best_static_hindsight"],
        "ttp_ratio_vs_surrogate_static": c / base["surrogate_static"],
        "ttp_ratio_vs_goodput_scaling": c / base["goodput_scaling"],
        "gap_to_oracle": (c - o) / o if o else None,
        "switches": max(len(cona["chain"]) - 1, 0),
        "switch_overhead_frac": cona["switch_s"] / cona["clock_s"] if cona["clock_s"] else 0.0,
        "gns_overhead_frac": cona["gns_s"] / cona["clock_s"] if cona["clock_s"] else 0.0,
        "decision_eval_frac": cona.get("decision_eval_frac", 0.0),
        "best_baseline": hindsight if best == "best_static_hindsight" else best,
        "best_static_hindsight": hindsight,
        "censored": sorted(k for k, t in live.items() if t is None),
    }
    return head, notes


def _quartiles(vals: list[float]) -> list[float]:
    if len(vals) < 2:
        return [vals[0], vals[0]] if vals else []
    q = statistics.quantiles(vals, n=4, method="inclusive")
    return [q[0], q[2]]


def aggregate(per_seed: dict) -> tuple[dict, dict]:
    """Median over seeds of each headline number and its spread (min, max, interquartile range, per seed);
    ``censored_seeds``: ``"seed: variant"`` for every variant censored at the budget (in the median, as censored
    times); ``gap_to_oracle_median`` and ``gap_to_oracle_iqr``: the gap reported with its spread, not a target."""
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
            "iqr": _quartiles(ok),
            "per_seed": vals,
            "seeds_without_value": len(vals) - len(ok),
        }
    head["gap_to_oracle_median"], head["gap_to_oracle_iqr"] = head["gap_to_oracle"], spread["gap_to_oracle"]["iqr"]
    head["best_baseline_per_seed"] = [h.get("best_baseline") for h in per_seed.values()]
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
        live = [
            budget_s if t is None else t for t, s in zip(ttts, seeds.values()) if not s["runs"][k]["stopped_behind"]
        ]
        out[k] = {kk: vv for kk, vv in r.items() if kk != "decisions"} | {
            "decisions": r["decisions"][:40],
            "decisions_total": len(r["decisions"]),
            "time_to_target_s_median": statistics.median(live) if live else None,  # None: stopped behind in every seed
            "censored_seeds": [
                seed for seed, t in zip(seeds, ttts) if t is None and not seeds[seed]["runs"][k]["stopped_behind"]
            ],
            "per_seed": {seed: _seed_summary(s["runs"][k]) for seed, s in seeds.items()},
        }
    return out


def strategy_changes(runs: dict, target_loss: float, window: int, levels: int = 4) -> dict:
    """Why switching can pay, measured in one seed: the static run first to each of ``levels`` losses evenly spaced
    from the untrained loss down to the target (a change of leader: the best static strategy changes during
    training), and the strategy the oracle kept in each phase (by held-out loss, of every global batch's branch)."""
    statics = {k: r["trace"] for k, r in runs.items() if k.startswith("static_")}
    top = max(tr[0][1] for tr in statics.values())
    leaders = []
    for i in range(1, levels + 1):
        loss = top + (target_loss - top) * i / levels
        hit = {k: t for k, tr in statics.items() if (t := time_to_target(tr, loss, window)) is not None}
        if hit:
            k = min(hit, key=lambda n: (hit[n], n))
            leaders.append({"loss": round(loss, 4), "first": k, "clock_s": hit[k]})
    kept = [c["strategy"] for c in runs["oracle"]["chain"]] if "oracle" in runs else []
    changes = sum(a["first"] != b["first"] for a, b in zip(leaders, leaders[1:]))
    return {
        "static_first_to_loss": leaders,
        "static_leader_changes": changes,
        "oracle_kept_by_phase": kept,
        "oracle_changes": sum(a != b for a, b in zip(kept, kept[1:])),
    }


def _seed_notes(cfg) -> list[str]:
    dev = set(cfg.development_seeds)
    overlap = sorted(dev & set(cfg.seed_list))
    if overlap:
        return [f"seeds {overlap} are development seeds (settings were chosen on them): not held out"]
    return [f"held-out seeds {cfg.seed_list}; settings (range_z, target) were chosen on seeds {sorted(dev)}"]


def bench_json(out: dict, cfg, quick: bool, wall_s: float) -> dict:
    """The bench's JSON from ``bench_worker``'s result."""
    per_seed, notes = {}, []
    for seed, r in out["seeds"].items():
        per_seed[seed], n = headline(r["runs"], cfg, seed)
        notes += n
    head, spread = aggregate(per_seed)
    first = next(iter(out["seeds"].values()))
    head["oracle_branches"] = len(first["step0"].get("oracle_branches", []))
    head["probe_table_fresh"] = out["probe"]["table"]["fresh"]
    head["held_out_seeds"] = [x for x in cfg.seed_list if x not in set(cfg.development_seeds)]
    changes = {
        seed: strategy_changes(r["runs"], cfg.target_loss, cfg.target_window) for seed, r in out["seeds"].items()
    }
    head["seeds_where_best_static_changes"] = sum(c["static_leader_changes"] > 0 for c in changes.values())
    notes += _seed_notes(cfg)
    room = head["oracle_gain_vs_best_baseline"]
    if room is not None and room < 0.05:
        notes.append(
            f"the oracle sequence gains only {room:.1%} over the best baseline (median over seeds) and the best static "
            f"changed during training in {head['seeds_where_best_static_changes']} of {len(changes)} seeds: this "
            f"configuration leaves switching little to gain, so oracle_gain_captured divides by a small difference"
        )
    notes.append(
        "static runs: the fastest strategy of every global batch (any other strategy of a batch trains the same "
        "samples at the same learning rate, slower by the probes); one past the clock another static reached the "
        "target at is stopped (stopped_behind), since it cannot be the best static in hindsight"
    )
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
        "held_out_seeds": head["held_out_seeds"],
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
        "best_strategy_changes": changes,
        "notes": notes,
        "emulated": False,
    }


def _fmt(v) -> str:
    return "n/a" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def _per_seed_time(p: dict) -> str:
    if p["time_to_target_s"] is not None:
        return f"{p['time_to_target_s']:.1f}"
    return f"stopped at {p['clock_s']:.1f}" if p.get("stopped_behind") else "-"


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
        per = ", ".join(_per_seed_time(p) for p in r["per_seed"].values())
        strat = " -> ".join(c["strategy"] for c in r["chain"])
        rows.append(
            f"| {k} | {'not reached or stopped' if t is None else f'{t:.1f}'}{cen} | {per} | {r['final_val_ppl']:.2f} | {r['steps']} "
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
