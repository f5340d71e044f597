"""Where a step's time goes: computing, waiting for a peer at a synchronisation point, transferring.

Every rank records its synchronisations of a step as ``(kind, peer, enter, exit, tag)`` (see
:class:`xronos.layers.CommStats`). On one machine the ranks share ``perf_counter``'s monotonic
clock, so the records of all ranks can be laid side by side:

- an all-reduce cannot finish before the last rank has entered it; a rank's **wait** there is the
  time from its own entry to the last rank's entry (capped by the time it spent inside), and the rest
  of its time inside is the **transfer** (moving and summing the data once everyone is there);
- a send or receive waits for its partner the same way: the k-th send from ``a`` to ``b`` pairs with
  the k-th receive at ``b`` from ``a``;
- a rank that finishes its step before the slowest one waits for it at the next step's barrier.

A rank's idle ratio is its wait over the step time (the slowest rank's wall time). The time inside
collectives (wait + transfer) plus the early finish is the time the rank is not computing.
"""

from __future__ import annotations

from collections import defaultdict

__all__ = ["step_waits", "segment_compute", "segment_jitter"]


def step_waits(records: list[dict]) -> list[dict]:
    """Per-rank wait and transfer seconds of one step from every rank's record (same step index).

    Each record needs ``step_s``, ``t1`` and ``syncs``. Returns, per rank, ``wait_s`` (waiting for
    peers, early finish included), ``transfer_s`` (inside a synchronisation after the partner(s)
    arrived), ``early_s`` (finished before the slowest rank) and ``step_s`` (the slowest rank's time).
    """
    world = len(records)
    t_sys = max(r["step_s"] for r in records)
    end = max(r["t1"] for r in records)
    out = [{"wait_s": 0.0, "transfer_s": 0.0, "early_s": end - r["t1"], "step_s": t_sys} for r in records]
    collectives = [[s for s in r["syncs"] if s[0] == "ar"] for r in records]
    n = min(len(c) for c in collectives)
    if any(len(c) != n for c in collectives):
        raise ValueError(f"ranks recorded different numbers of all-reduces: {[len(c) for c in collectives]}")
    for k in range(n):
        last = max(c[k][2] for c in collectives)
        for r in range(world):
            t0, t1 = collectives[r][k][2], collectives[r][k][3]
            w = min(max(0.0, last - t0), t1 - t0)
            out[r]["wait_s"] += w
            out[r]["transfer_s"] += (t1 - t0) - w
    # point-to-point: pair the k-th send a->b with the k-th receive at b from a
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, rec in enumerate(records):
        for kind, peer, t0, t1, *_ in rec["syncs"]:
            if kind == "send":
                sends[(r, peer)].append((t0, t1))
            elif kind == "recv":
                recvs[(peer, r)].append((t0, t1))
    for (a, b), ops in sends.items():
        other = recvs.get((a, b), [])
        if len(other) != len(ops):
            raise ValueError(f"rank {a} sent {len(ops)} messages to rank {b}, which received {len(other)}")
        for (s0, s1), (r0, r1) in zip(ops, other):
            ws = min(max(0.0, r0 - s0), s1 - s0)  # sender waits for the receiver to post
            wr = min(max(0.0, s0 - r0), r1 - r0)  # receiver waits for the sender's data
            out[a]["wait_s"] += ws
            out[a]["transfer_s"] += (s1 - s0) - ws
            out[b]["wait_s"] += wr
            out[b]["transfer_s"] += (r1 - r0) - wr
    for o in out:
        o["wait_s"] += o["early_s"]
    return out


def segment_compute(record: dict, num_layers: int | None = None) -> dict | None:
    """Compute seconds of one tensor-parallel step split by the kind of synchronisation that ends them.

    Each all-reduce of a TP step is tagged with the segment it closes: "attn" after a layer's attention
    forward and before its backward completes, "mlp" likewise for the MLP; the compute before such an
    all-reduce is charged to that segment, everything else (embedding, LM head, loss, clipping and the
    optimizer after the last all-reduce) to "other". None when the step has no tagged all-reduce
    (a pipeline step, or one rank alone). ``num_layers``, when given, checks that every layer was seen.
    """
    syncs = record["syncs"]
    tags = [s[4] if len(s) > 4 else "" for s in syncs]
    if not syncs or any(s[0] != "ar" for s in syncs) or not {"attn", "mlp"} <= set(tags):
        return None
    if num_layers is not None and (tags.count("attn") != 2 * num_layers or tags.count("mlp") != 2 * num_layers):
        return None
    out = {"attn": 0.0, "mlp": 0.0, "other": 0.0}
    prev = record["t0"]
    for s, tag in zip(syncs, tags):
        out[tag if tag in ("attn", "mlp") else "other"] += max(0.0, s[2] - prev)
        prev = s[3]
    out["other"] += max(0.0, record["t1"] - prev)
    return out


def segment_jitter(records: list[dict], min_s: float = 0.005) -> float | None:
    """How much one rank's compute between the same two synchronisations varies from step to step.

    For every synchronisation index k the compute before it (from the previous synchronisation's exit,
    or the step start) is collected over ``records`` (one rank's steps with the same synchronisation
    pattern); returns the median over k of the coefficient of variation (stdev / mean), ignoring
    segments shorter than ``min_s``. Two ranks whose segments vary by c each wait about
    0.56 * c of a segment at every synchronisation (normal jitter) even when perfectly balanced on
    average: a floor under the idle ratio that no partition can remove. None if there is too little data.
    """
    import statistics

    n = {len(r["syncs"]) for r in records}
    if len(records) < 3 or len(n) != 1:
        return None
    cvs = []
    for k in range(n.pop()):
        segs = [r["syncs"][k][2] - (r["t0"] if k == 0 else r["syncs"][k - 1][3]) for r in records]
        mean = statistics.fmean(segs)
        if mean >= min_s:
            cvs.append(statistics.pstdev(segs) / mean)
    return statistics.median(cvs) if cvs else None
