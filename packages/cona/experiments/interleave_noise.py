"""How far apart do the clocks of identical variants drift when the harness interleaves them?

Runs ``--copies`` copies of one strategy, from the same weights on the same sample stream (so every copy takes
bitwise the same steps), side by side in the bench's interleaved slices of training clock, once per slice length
in ``--slices`` (0 = lockstep: every copy takes exactly one step per turn). Any difference between the copies'
clocks at the same step is timing noise of the harness, the floor under every comparison the bench makes between
variants (cona against surrogate_static or the oracle's branches). Per slice it prints the copies' clocks at the
last step all reached, their spread (max / min - 1) and the sd of their logs; the slices are run in turn,
``--repeats`` times, so the VM's slow minutes fall on every setting:

    python experiments/interleave_noise.py --world 4 --strategy dp2-tp1-pp2-mb32-gb64 --slices 0.5,0.1,0 \
        --clock 8 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

from cona.dist import launch


def _worker(rank: int, world: int, name: str, copies: int, slices: list[float], clock: float, repeats: int) -> dict:
    import cona.train as T

    cfg = T.BenchConfig(world=world, probe_cache=False, oracle=False)
    tr = T._Trainer(cfg)
    by_name = {s.name: s for s in tr.candidates}
    if name not in by_name:
        raise ValueError(f"strategy {name!r} is not a candidate for world {world}; e.g. {sorted(by_name)[:4]}")
    s = by_name[name]
    out: dict[str, list[dict]] = {str(x): [] for x in slices}
    for _ in range(repeats):
        for sl in slices:
            runs = [T.Run(f"copy{i}") for i in range(copies)]
            vs = [tr.variant(r, s, tr.state0) for r in runs]
            steps_at: list[list[float]] = [[] for _ in vs]  # each copy's clock after every step
            rnd, t = 0, sl
            while any(r.clock < clock for r in runs):
                k = rnd % copies
                for i in list(range(k, copies)) + list(range(k)):  # rotated, as the bench's turns are
                    v, r = vs[i], runs[i]
                    until = min(r.clock + 1e-9 if sl == 0 else t, clock)  # lockstep: one step
                    while not v.done and r.clock < until:  # one step at a time, so every step has its own clock
                        v.advance(r.clock + 1e-9, stop_at_target=False)
                        steps_at[i].append(r.clock)
                t += sl
                rnd += 1
            n = min(len(x) for x in steps_at)
            end = [x[n - 1] for x in steps_at]
            logs = [math.log(c) for c in end]
            out[str(sl)].append({"steps": n, "clocks": end, "spread": max(end) / min(end) - 1,
                                 "sd_log": statistics.stdev(logs)})  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--strategy", required=True)
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--slices", default="0.5,0.1,0", help="comma-separated slice lengths in s; 0 = lockstep")
    p.add_argument("--clock", type=float, default=8.0, help="training clock per copy and setting (s)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    slices = [float(x) for x in a.slices.split(",")]
    res = launch(_worker, a.world, a.strategy, a.copies, slices, a.clock, a.repeats, timeout_s=3600.0)[0]
    for sl, reps in res.items():
        for r in reps:
            clocks = ", ".join(f"{c:.3f}" for c in r["clocks"])
            print(f"slice {sl:>4}: {r['steps']} steps, clocks [{clocks}], "
                  f"spread {r['spread']:.4f}, sd(log) {r['sd_log']:.4f}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
