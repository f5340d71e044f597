"""Replay the chains of a ``cona bench --json`` run on other sample streams: how much of cona's gap to the oracle
is its chain, and how much the oracle's keeping the best of its branches on its own stream.

The oracle branches every candidate from the same checkpoint each phase and keeps the branch with the lowest
held-out loss. Its branches share the weights and the sample stream up to the phase start, but each trains on its
own grouping of the samples, so it also keeps the branch whose optimizer noise happened to help; that luck is part
of its time and no online rule can have it. Replayed on a stream neither run saw, a chain keeps only what it is: a
sequence of global batches over time.

For every seed of the bench, the oracle's chain and cona's chain (the strategy held over each stretch of training
samples where the chain records them, else of clock) are replayed on one process from the seed's initial weights,
with the bench's model, learning-rate rule, AdamW and clipping (``cona.executor.Executor``, one rank: only the
global batches matter, layouts change the floating-point order alone), on the seed's own stream (``stream 0``) and
on ``--streams`` others (the seed's sample permutation from a distant offset: the same corpus and validation
windows, other samples). The clock is virtual and
the same for both chains: a step advances it by global batch / the samples/s the bench's probe table gives that
strategy; evaluations every ``eval_every_s`` of it and time to target are read as the bench reads them. cona's own
costs (statistics, its decisions' evaluations, resharding; ~2% of its clock on 4 ranks) are not replayed: chains
only, so cona's replayed gap is below its bench gap by about that much. Results are measured, on this machine's
CPU, and say nothing about step times (the clock is the table's).

    python experiments/chain_replay.py /work/runs/r7.json --streams 2 --json /tmp/cona-replay.json

``--fixed 64:0,128:3,256:7.5`` (repeatable) also replays a chain written by hand, global batch:clock of its start (each
global batch on its fastest strategy of the probe table), on the same streams, and reports it against cona's chain:
e.g. when the move to gb256 pays, free of the bench's timing noise and of any one stream's luck.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import hwtopo

OFFSET = 60_000  # samples between streams: a bench run trains on fewer than 40k, the permutation holds 262144


def _schedule(chain: list[dict]) -> tuple[str, list[tuple[float, int, str]]]:
    """What the chain switches by, and (position from which it holds, global batch, strategy name) per entry.

    Chains written since 2026-12-03 record the samples trained at each switch: the replay switches there, so on
    the seed's own stream it trains on the run's batches in the run's order (its weights differ by floating-point
    order only). Older chains have only the clock, read on the virtual clock (not the run's: the shape in time)."""
    by = _switches_by([chain])
    out = []
    for i, e in enumerate(chain):
        out.append((0.0 if i == 0 else float(e[by]), int(e["strategy"].rsplit("gb", 1)[1]), e["strategy"]))
    return by, out


def _fixed(spec: str, tput: dict[str, float]) -> tuple[str, list[tuple[float, int, str]]]:
    """The schedule of a ``--fixed`` chain: ``gb:clock`` entries, the first at clock 0, clocks increasing; each
    global batch on the fastest strategy of the probe table ``tput`` that has it."""
    out = []
    for part in spec.split(","):
        gb, _, at = part.partition(":")
        try:
            at_s = float(at)
        except ValueError:
            at_s = None
        if at_s is not None and not math.isfinite(at_s):  # float() takes nan and inf
            at_s = None
        if not (gb.strip().isdigit() and at_s is not None):
            raise ValueError(f"--fixed entries must be global_batch:clock_s, got {part!r} in {spec!r}")
        names = [n for n in tput if n.endswith(f"-gb{int(gb)}")]
        if not names:
            raise ValueError(f"--fixed {spec!r}: no strategy of global batch {gb} in the probe table")
        out.append((at_s, int(gb), max(names, key=lambda n: tput[n])))
    clocks = [t for t, _, _ in out]
    if clocks[0] != 0.0 or clocks != sorted(clocks):
        raise ValueError(f"--fixed {spec!r}: the first entry must start at clock 0 and the clocks must increase")
    return "clock", out


def _table(bench: dict) -> dict[str, float]:
    """The bench's probe table: samples/s by strategy name."""
    return {n: v["samples_per_s"] for n, v in bench["probe"]["throughput"].items()}


def _replay(cfg, mcfg, data, val, seed: int, schedule, tput: dict[str, float], offset: int) -> dict:
    from cona.executor import Executor, initial_state
    from cona.space import Strategy
    from cona.train import time_to_target

    by, sched = schedule
    ex, i, clock, consumed, steps = None, 0, 0.0, offset, 0
    state = initial_state(mcfg, seed)
    trace: list[tuple[float, float]] = []
    next_eval = 0.0
    while clock < cfg.budget_s:
        while i + 1 < len(sched) and (clock if by == "clock" else consumed - offset) >= sched[i + 1][0]:
            i += 1
        gb, name = sched[i][1], sched[i][2]
        s = Strategy(1, 1, 1, min(32, gb), gb)
        if ex is None:
            ex = Executor(s, mcfg, state, lr=cfg.lr_for(gb), clip_norm=cfg.clip_norm, betas=cfg.adam_betas)
        elif ex.s != s:
            ex = ex.retarget(s)  # one rank: every strategy has the same layout, nothing moves
        if clock >= next_eval:
            trace.append((clock, ex.evaluate(val)))
            next_eval = clock + cfg.eval_every_s
            ttt = time_to_target(trace[-cfg.target_window :], cfg.target_loss, cfg.target_window)
            if ttt is not None:
                return {"time_to_target_s": ttt, "samples": consumed - offset, "steps": steps}
        ex.train_step(data.samples(consumed, gb), lr=cfg.lr_for(gb), gns=False)
        consumed += gb
        steps += 1
        clock += gb / tput[name]
    return {"time_to_target_s": None, "samples": consumed - offset, "steps": steps}


def _worker(rank: int, world: int, bench: dict, seeds: list[str], streams: int, progress: bool,
            fixed: dict[str, tuple] | None = None) -> dict:  # fmt: skip
    """Replays per seed; ``fixed``: hand-written chains' schedules (``_fixed``), by their spec."""
    from cona.model import TextData, stdlib_tokens, tiny_llama_config
    from cona.train import BenchConfig

    known = set(BenchConfig.__dataclass_fields__)
    cfg = BenchConfig(**{k: v for k, v in bench["config"].items() if k in known})
    mcfg = tiny_llama_config(cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.intermediate)
    tokens = stdlib_tokens(cfg.corpus_bytes)  # read once, not per replay
    tput = _table(bench)
    res = bench["results"]
    fixed = fixed or {}
    out = {}
    for seed in seeds:
        data = TextData(tokens, cfg.seq_len, int(seed))
        val = data.validation(cfg.val_samples)
        row = {"bench": {k: res[k]["per_seed"][seed]["time_to_target_s"] for k in ("cona", "oracle")}}
        for who in ("oracle", "cona", *fixed):
            sched = fixed[who] if who in fixed else _schedule(res[who]["per_seed"][seed]["chain"])
            row[who] = [_replay(cfg, mcfg, data, val, int(seed), sched, tput, k * OFFSET) for k in range(streams + 1)]
            if progress:
                print(f"seed {seed} {who}: " + ", ".join(str(r["time_to_target_s"] and round(r["time_to_target_s"], 2))
                                                         for r in row[who]), file=sys.stderr, flush=True)  # fmt: skip
        out[seed] = row
    return out


def _summary(rows: dict, budget_s: float, fixed: tuple[str, ...] = ()) -> dict:
    def t(r):
        return r["time_to_target_s"] if r["time_to_target_s"] is not None else budget_s

    def vs_cona(row, who):  # every stream's time against cona's chain's on that stream, mean over streams
        return statistics.mean(t(a) / t(b) for a, b in zip(row[who], row["cona"])) - 1

    own, fresh, sel, ctl = [], [], [], []
    for row in rows.values():
        o, c = [t(r) for r in row["oracle"]], [t(r) for r in row["cona"]]
        own.append(c[0] / o[0] - 1)
        fresh.append(statistics.mean(c[1:]) / statistics.mean(o[1:]) - 1)
        sel.append(o[0] / statistics.mean(o[1:]) - 1)
        ctl.append(c[0] / statistics.mean(c[1:]) - 1)
    med = statistics.median
    return {
        "gap_replayed_own_stream": med(own),  # cona's chain vs the oracle's, on the stream both ran on
        "gap_replayed_other_streams": med(fresh),  # on streams neither saw (mean over them per seed)
        "oracle_own_vs_other_streams": med(sel),  # < 0: its chain did better on the stream it was picked on
        "cona_own_vs_other_streams": med(ctl),  # the control: cona did not pick on outcomes
        "per_seed": {
            s: {"own": a, "other": b, "oracle_own_vs_other": x, "cona_own_vs_other": y}
            for s, a, b, x, y in zip(rows, own, fresh, sel, ctl)
        },  # fmt: skip
        "clock": "virtual: global batch / the bench's probed samples/s per step; cona's own costs not replayed",
    } | ({"fixed_vs_cona": {f: {"median": med(v := [vs_cona(row, f) for row in rows.values()]), "per_seed": v}
                            for f in fixed}} if fixed else {})  # fmt: skip


def _switches_by(chains: list[list[dict]]) -> str:
    """ "samples" when every entry of every chain records them (chains written since 2026-12-03), else "clock"."""
    return "samples" if all("samples" in e for c in chains for e in c) else "clock"


def main(argv: list[str] | None = None) -> int:
    from cona.dist import launch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench_json", help="a `cona bench --json` result (its config, probe table and chains)")
    p.add_argument("--streams", type=int, default=2, help="other sample streams per chain (default 2)")
    p.add_argument("--seeds", help="comma-separated seeds of the bench (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the results here (atomically)")
    p.add_argument(
        "--fixed",
        action="append",
        default=[],
        metavar="GB:CLOCK,...",
        help="also replay this hand-written chain (e.g. 64:0,128:3,256:7.5) against cona's; repeatable",
    )
    a = p.parse_args(argv)
    if a.streams < 1:
        p.error(f"--streams must be >= 1, got {a.streams}")
    with open(a.bench_json) as f:
        bench = json.load(f)
    seeds = list(bench["results"]["cona"]["per_seed"])
    if a.seeds:
        want = a.seeds.split(",")
        bad = [s for s in want if s not in seeds]
        if bad:
            p.error(f"--seeds {','.join(bad)} not in the bench (it has {','.join(seeds)})")
        seeds = want
    tput = _table(bench)
    try:  # parsed once, here, so a bad spec fails before any replay
        fixed = {f: _fixed(f, tput) for f in a.fixed}
    except ValueError as e:
        p.error(str(e))
    rows = launch(_worker, 1, bench, seeds, a.streams, True, fixed, timeout_s=7200, threads=a.threads)[0]
    out = {"bench": os.path.abspath(a.bench_json), "streams": a.streams, "offset": OFFSET,
           "switches_by": _switches_by([r["chain"] for k in ("oracle", "cona")
                                        for r in bench["results"][k]["per_seed"].values()]),
           "summary": _summary(rows, bench["config"]["budget_s"], tuple(fixed)), "seeds": rows}  # fmt: skip
    print(json.dumps({k: v for k, v in out["summary"].items() if k != "per_seed"}, indent=1))
    if a.json:
        hwtopo.atomic_write_text(a.json, json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
