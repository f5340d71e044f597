"""Pool one headline number's per-seed values over several ``cona bench --json`` runs of the same configuration.

A bench headline is the median over its seeds, and on a noisy clock one 10-seed median of ``gap_to_oracle`` moves
by ~0.025 from run to run on the same code and table. Whether a target holds is then a question about the
distribution the runs sample, not about one run: this reads each run's per-seed values (``headline_spread``),
pools them, and reports the pooled median and mean, a bootstrap interval for the pooled median, and, by
resampling the pooled seeds, how often a run of each run's seed count would read above ``--target``. Runs whose
configurations differ (other than seeds, wall time and the probe cache) are refused with the field named: pooling
them would mix two experiments. Reads the runs' JSON only; runs nothing.

    python experiments/pool_gaps.py run1.json run2.json --target 0.05 --json pooled.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

import hwtopo

RUN_LOCAL = {"seed", "seeds", "seed_list", "wall_s", "probe_cache"}  # differ between runs of one experiment


def per_seed(bench: dict, key: str) -> list[float]:
    """The per-seed values of headline ``key`` in one run (seeds without a value left out)."""
    spread = bench.get("headline_spread", {})
    if key not in spread:
        raise ValueError(
            f"key {key!r} is not in the run's headline_spread (keys: {', '.join(sorted(spread)) or 'none'})"
        )
    return [float(v) for v in spread[key]["per_seed"] if v is not None]


def config_difference(a: dict, b: dict) -> str | None:
    """The first configuration field (other than ``RUN_LOCAL``) whose value differs between two runs, or None."""
    ca, cb = a.get("config", {}), b.get("config", {})
    for k in sorted((set(ca) | set(cb)) - RUN_LOCAL):
        if ca.get(k) != cb.get(k):
            return k
    return None


def _bootstrap_medians(values: list[float], n: int, draws: int, rng: random.Random) -> list[float]:
    return sorted(statistics.median(rng.choices(values, k=n)) for _ in range(draws))


def pool(
    runs: dict[str, dict], key: str = "gap_to_oracle", target: float = 0.05, draws: int = 20000, seed: int = 0
) -> dict:
    """Per run: its seeds and median; pooled: median, mean, the 5-95% bootstrap interval of the pooled median, and
    per seed count of the runs the probability that a run's median reads above ``target``."""
    if not runs:
        raise ValueError("runs must name at least one bench JSON")
    if draws < 100:
        raise ValueError(f"draws must be >= 100, got {draws}")
    names = list(runs)
    for n in names[1:]:
        if (k := config_difference(runs[names[0]], runs[n])) is not None:
            raise ValueError(f"config field {k!r} differs between {names[0]} and {n}: pool runs of one configuration")
    vals = {n: per_seed(b, key) for n, b in runs.items()}
    for n, v in vals.items():
        if not v:
            raise ValueError(f"run {n} has no per-seed value of {key}")
    pooled = [x for v in vals.values() for x in v]
    rng = random.Random(seed)
    meds = _bootstrap_medians(pooled, len(pooled), draws, rng)
    above = {}
    for k in sorted({len(v) for v in vals.values()}):
        m = _bootstrap_medians(pooled, k, draws, rng)
        above[str(k)] = sum(x > target for x in m) / draws
    return {
        "key": key,
        "target": target,
        "runs": {n: {"seeds": len(v), "median": statistics.median(v)} for n, v in vals.items()},
        "pooled": {
            "seeds": len(pooled),
            "median": statistics.median(pooled),
            "mean": statistics.mean(pooled),
            "median_interval_90": [meds[int(0.05 * draws)], meds[int(0.95 * draws) - 1]],
            "at_or_under_target": sum(x <= target for x in pooled),
        },
        "p_run_median_above_target": above,
        "bootstrap": {"draws": draws, "seed": seed},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench_json", nargs="+", help="`cona bench --json` results of one configuration")
    p.add_argument("--key", default="gap_to_oracle", help="headline key to pool (default gap_to_oracle)")
    p.add_argument("--target", type=float, default=0.05, help="the key's target (default 0.05)")
    p.add_argument("--draws", type=int, default=20000, help="bootstrap resamples (default 20000)")
    p.add_argument("--json", help="write the result here (atomically)")
    args = p.parse_args(argv)
    runs = {}
    for path in args.bench_json:
        try:
            with open(path) as f:
                runs[path] = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"pool_gaps: cannot read bench_json {path}: {e}", file=sys.stderr)
            return 2
    try:
        out = pool(runs, args.key, args.target, args.draws)
    except ValueError as e:
        print(f"pool_gaps: {e}", file=sys.stderr)
        return 2
    for n, r in out["runs"].items():
        print(f"{n}: {r['seeds']} seeds, median {r['median']:+.3f}")
    pl = out["pooled"]
    lo, hi = pl["median_interval_90"]
    print(
        f"pooled: {pl['seeds']} seeds, median {pl['median']:+.3f} (90% bootstrap {lo:+.3f}..{hi:+.3f}), mean "
        f"{pl['mean']:+.3f}, {pl['at_or_under_target']} at or under {args.target:g}"
    )
    for k, pa in out["p_run_median_above_target"].items():
        print(f"a {k}-seed run's median above {args.target:g}: {pa:.1%} of resampled runs")
    if args.json:
        hwtopo.atomic_write_text(args.json, json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
