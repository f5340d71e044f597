"""How stable are probed throughput ratios from pass to pass, for short and long timings?

Runs the bench's executors on ``--world`` spawned ranks (gloo on CPU). Each pass builds every listed
strategy in turn, in ``--rounds`` interleaved rounds as the harness's probe does, and times it twice per
round: ``--short`` steps of one repeated batch after one warm-up (the probe's timing, median step kept) and
``--long`` training-like steps (fresh batches, the bench's learning rate; median kept); the median round
is reported. Every pass prints the samples/s of each strategy and its
ratio to the first strategy listed, so the spread of the ratios over passes shows what each timing can
resolve. Behind ``BenchConfig.probe_steps`` (README, "Throughput probes"):

    python experiments/probe_stability.py --world 4 --passes 3 \
        --strategies dp2-tp1-pp2-mb32-gb64,dp4-tp1-pp1-mb32-gb128,dp4-tp1-pp1-mb32-gb256
"""

from __future__ import annotations

import argparse
import statistics
import time

from cona.dist import launch


def _worker(rank: int, world: int, names: list[str], short: int, long: int, rounds: int) -> dict:
    import cona.train as T
    from cona.probe import time_steps

    cfg = T.BenchConfig(world=world, probe_cache=False)
    tr = T._Trainer(cfg)
    by_name = {s.name: s for s in tr.candidates}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"strategies {missing} are not candidates for world {world}; e.g. {sorted(by_name)[:4]}")
    got: dict[str, dict[str, list[float]]] = {n: {"short": [], "long": []} for n in names}
    for _ in range(rounds):  # interleaved over the strategies, as the harness's probe rounds are
        for n in names:
            s = by_name[n]
            ex = tr.executor(s, tr.state0)
            batch = tr.data.samples(0, s.global_batch)
            got[n]["short"].append(
                T._bcast(time_steps(lambda ex=ex, batch=batch: ex.train_step(batch, gns=False), short))
            )
            times, consumed = [], 0
            for _ in range(long):
                b = tr.data.samples(consumed, s.global_batch)
                consumed += s.global_batch
                t0 = time.perf_counter()
                ex.train_step(b, lr=cfg.lr_for(s.global_batch), gns=False)
                times.append(T._bcast(time.perf_counter() - t0))
            got[n]["long"].append(statistics.median(times))
            del ex
    return {n: {k: by_name[n].global_batch / statistics.median_low(v) for k, v in g.items()} for n, g in got.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--strategies", required=True, help="comma-separated strategy names; ratios are to the first")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per pass, median kept (the probe's 3)")
    p.add_argument("--short", type=int, default=5, help="timed steps of the short (probe-like) timing")
    p.add_argument("--long", type=int, default=40, help="timed steps of the long (training-like) timing")
    a = p.parse_args()
    names = a.strategies.split(",")
    ratios: dict[str, dict[str, list[float]]] = {k: {n: [] for n in names[1:]} for k in ("short", "long")}
    for i in range(a.passes):
        r = launch(_worker, a.world, names, a.short, a.long, a.rounds)[0]
        for k in ("short", "long"):
            row = ", ".join(f"{n} {r[n][k]:.0f}" for n in names)
            for n in names[1:]:
                ratios[k][n].append(r[n][k] / r[names[0]][k])
            print(f"pass {i} {k:5s} samples/s: {row}", flush=True)
    for k in ("short", "long"):
        for n, rs in ratios[k].items():
            print(f"{k:5s} {n} / {names[0]}: " + ", ".join(f"{x:.2f}" for x in rs))


if __name__ == "__main__":
    main()
