"""How much of the oracle's lead is timing luck: did the branch it kept each phase run faster than its rivals?

The oracle branches every candidate from one checkpoint each phase, trains each for the same clock and keeps the
one with the lowest held-out loss. A branch whose steps happened to run fast (the machine's speed swings from
moment to moment) trains more samples in the phase and so leads for a reason the strategy does not own. Each
branch's outcome in a ``cona bench --json`` run records its ``samples`` and ``train_s`` in the phase (since commit
7f5cd73), so its realised rate over the rate the probe table gives its strategy says how fast its moments were.
Per phase this reports the kept branch's relative rate against the mean of the other branches' and against the
runner-up's (second lowest held-out loss, of any global batch); ``--min-global-batch`` (default 64) leaves the
small batches out of the former (and phases that kept one), as they rarely contend late and run other layouts. It also reports, per run, each variant's time to target against
surrogate_static (the step-0 choice held, which shares cona's first step), so cona's and the oracle's gains are
read on one scale. Reads the runs' JSON only; runs nothing.

    python experiments/oracle_luck.py /work/runs/r22.json /work/runs/r22b.json --json /tmp/luck.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import hwtopo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chain_replay import _table  # noqa: E402  (the probe table, read as the replays read it)


def _gb(name: str) -> int:
    return int(name.rsplit("gb", 1)[1])


def phase_luck(bench: dict, min_global_batch: int = 64) -> list[dict]:
    """Per oracle phase whose kept branch and at least one other timed branch have global batch >=
    ``min_global_batch``: the kept branch's realised rate over its table rate, relative to those others' mean
    (``vs_others``) and to the runner-up by held-out loss among all its branches (``vs_runner_up``; None when the
    runner-up's time was not recorded)."""
    table = _table(bench)
    out = []
    for seed, run in bench["results"]["oracle"]["per_seed"].items():
        for ph in run["chain"]:
            rate = {b["strategy"]: b["samples"] / b["train_s"] / table[b["strategy"]]
                    for b in ph.get("branches", []) if b.get("train_s")}  # fmt: skip
            kept = ph["strategy"]
            others = [v for n, v in rate.items() if n != kept and _gb(n) >= min_global_batch]
            if kept not in rate or _gb(kept) < min_global_batch or not others:
                continue
            ranked = sorted((b["held_out_mean_at_compare"], b["strategy"]) for b in ph["branches"]
                            if b.get("held_out_mean_at_compare") is not None and b["strategy"] != kept)  # fmt: skip
            runner = ranked[0][1] if ranked else None
            out.append({
                "seed": seed, "clock": ph["clock"], "kept": kept,
                "vs_others": rate[kept] / statistics.mean(others) - 1,
                "vs_runner_up": rate[kept] / rate[runner] - 1 if runner in rate else None,
            })  # fmt: skip
    return out


def against_static(bench: dict) -> dict[str, float]:
    """Median over seeds of each variant's time to target over surrogate_static's, minus 1 (seeds where either
    missed the target are left out)."""
    res = bench["results"]
    out = {}
    for who in ("cona", "oracle", "best_static"):
        if who not in res:
            continue
        rel = [t / s - 1 for seed, r in res[who]["per_seed"].items()
               if (t := r["time_to_target_s"]) and (s := res["surrogate_static"]["per_seed"][seed]["time_to_target_s"])]  # fmt: skip
        if rel:
            out[who] = statistics.median(rel)
    return out


def summary(bench: dict, min_global_batch: int = 64) -> dict:
    phases = phase_luck(bench, min_global_batch)
    if not phases:
        raise ValueError("no oracle phase records its branches' samples and train_s with two or more branches of "
                         f"global batch >= {min_global_batch}: a run of commit 7f5cd73 or later is needed")  # fmt: skip
    others = [p["vs_others"] for p in phases]
    runner = [p["vs_runner_up"] for p in phases if p["vs_runner_up"] is not None]
    return {
        "phases": len(phases),
        "kept_vs_others_median": statistics.median(others),
        "kept_vs_others_mean": statistics.mean(others),
        "kept_vs_runner_up_median": statistics.median(runner) if runner else None,
        "kept_vs_runner_up_mean": statistics.mean(runner) if runner else None,
        "time_to_target_vs_surrogate_static": against_static(bench),
        "per_phase": phases,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench_json", nargs="+", help="`cona bench --json` results (commit 7f5cd73 or later)")
    p.add_argument("--min-global-batch", type=int, default=64,
                   help="compare branches of at least this global batch (default 64)")  # fmt: skip
    p.add_argument("--json", help="write the results here (atomically)")
    a = p.parse_args(argv)
    if a.min_global_batch < 1:
        p.error(f"--min-global-batch must be >= 1, got {a.min_global_batch}")
    out = {}
    for path in a.bench_json:
        try:
            with open(path) as f:
                bench = json.load(f)
            out[path] = summary(bench, a.min_global_batch)
        except (OSError, json.JSONDecodeError, KeyError, ValueError) as e:
            p.error(f"{path}: {type(e).__name__}: {e}")
        print(path, json.dumps({k: v for k, v in out[path].items() if k != "per_phase"}))
    if a.json:
        hwtopo.atomic_write_text(a.json, json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
