"""Does the oracle's pick on the windows between the measuring ones select on the measuring windows' own noise?

The oracle keeps, each phase, the branch with the lowest loss on held-out windows, and its time to target is read on
the measuring windows. Before ``BenchConfig.held_out_bytes`` the held-out windows lay halfway between the measuring ones: disjoint, but
~390 bytes from them in the same source files, so a branch that happens to fit those files' identifiers and idioms
reads low on both. This experiment branches the bench's candidate batches from one gb64 checkpoint (one process,
one thread, the bench's model, learning-rate rule, clipping and AdamW), trains each for the samples one oracle
phase gives it (``--phase-samples``, from a 4-rank probe table), and evaluates every branch on

- M: the 128 measuring windows (``TextData.validation``),
- B: the 127 windows between them (``TextData.validation_between``, the old held-out set),
- S1, S2: windows of two other text regions, text never trained or measured on (``TextData.held_out``).

For each pair of branches of an instance, the difference of their losses in each set; across instances, after the
mean difference of the pair is removed (the part due to the strategies themselves), the covariance of the
differences between two sets is the noise the sets share. cov(S1, S2) is what independent text shares: the
branches' real quality. cov(M, B) above it is the measuring windows' own noise that a pick on B selects.
Finally the pick itself: the measuring-window loss of the branch each set would keep, against the branch S2 keeps.

    python experiments/held_out_overlap.py --seeds 0-11 --checkpoints 6000,12000,18000
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics

import torch
from batch_efficiency import adam, lr_for, step, train_to, val_loss  # same directory

from cona.model import TextData, stdlib_tokens, tiny_llama_config

SETS = ("M", "B", "S1", "S2")


def _ints(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return out


def instance(cfg, tokens, seed: int, checkpoint: int, phase: dict[int, int]) -> dict:
    data = TextData(tokens, 32, seed, held_out_tokens=len(tokens) - 1_000_000)
    sets = {"M": data.validation(128), "B": data.validation_between(128)}
    held = data.held_out(254)
    sets["S1"], sets["S2"] = held[:127], held[127:]
    model, opt, used = train_to(cfg, data, seed, checkpoint)
    out = {"seed": seed, "checkpoint": used, "branches": {}}
    for gb, samples in phase.items():
        m = copy.deepcopy(model)
        o = adam(m.parameters(), lr_for(gb))
        o.load_state_dict(opt.state_dict())
        for g in o.param_groups:
            g["lr"] = lr_for(gb)
        u = 0
        while u < samples:
            step(m, o, data.samples(used + u, gb))
            u += gb
        out["branches"][gb] = {k: val_loss(m, v) for k, v in sets.items()}
    return out


def summarize(runs: list[dict]) -> dict:
    by_ckpt: dict[int, list[dict]] = {}
    for r in runs:
        by_ckpt.setdefault(r["checkpoint"], []).append(r)
    res = {}
    for ckpt, rs in sorted(by_ckpt.items()):
        gbs = sorted(rs[0]["branches"])
        pairs = [(a, b) for i, a in enumerate(gbs) for b in gbs[i + 1 :]]
        # centred differences per pair and set
        cen = {k: [] for k in SETS}
        for a, b in pairs:
            d = {k: [r["branches"][a][k] - r["branches"][b][k] for r in rs] for k in SETS}
            for k in SETS:
                mu = statistics.fmean(d[k])
                cen[k] += [x - mu for x in d[k]]

        def cov(x, y, cen=cen):
            return statistics.fmean(p * q for p, q in zip(cen[x], cen[y], strict=True))

        # the pick: the measuring-window loss of the branch each set keeps, minus that of the branch S2 keeps
        pick = {}
        for k in ("M", "B", "S1"):
            gain = []
            for r in rs:
                kept = min(gbs, key=lambda g: r["branches"][g][k])
                ref = min(gbs, key=lambda g: r["branches"][g]["S2"])
                gain.append(r["branches"][kept]["M"] - r["branches"][ref]["M"])
            pick[k] = statistics.fmean(gain)
        res[ckpt] = {
            "instances": len(rs),
            "loss_M": statistics.fmean(r["branches"][64]["M"] for r in rs),
            "var": {k: cov(k, k) for k in SETS},
            "cov": {
                f"{x}-{y}": cov(x, y) for x, y in (("M", "B"), ("M", "S1"), ("M", "S2"), ("S1", "S2"), ("B", "S1"))
            },
            "pick_vs_S2_on_M": pick,
        }
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-7", help="seeds (init and sample stream), e.g. 0-15 or 0,3,5")
    ap.add_argument("--checkpoints", default="12000", help="samples trained at gb64 before the branches")
    ap.add_argument("--phase-samples", default="64:5800,128:7000,256:8500",
                    help="GB:SAMPLES per branch: one 3 s phase at the 4-rank table's rates")  # fmt: skip
    ap.add_argument("--json", help="write the instances and the summary here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = tiny_llama_config(2, 32, 4, 2, 96)
    tokens = stdlib_tokens(1_300_000)
    phase = {int(a): int(b) for a, b in (p.split(":") for p in args.phase_samples.split(","))}
    runs = []
    for ckpt in _ints(args.checkpoints):
        for seed in _ints(args.seeds):
            r = instance(cfg, tokens, seed, ckpt, phase)
            runs.append(r)
            print(f"ckpt {ckpt} seed {seed}: " + "  ".join(
                f"gb{g} " + " ".join(f"{k}={v:.4f}" for k, v in b.items()) for g, b in r["branches"].items()),
                flush=True)  # fmt: skip
    res = summarize(runs)
    for ckpt, s in res.items():
        print(f"checkpoint {ckpt} ({s['instances']} instances, gb64 branch M loss {s['loss_M']:.3f}, "
              f"ppl {math.exp(s['loss_M']):.2f})")  # fmt: skip
        print("  var of centred pair differences (1e-6 nats^2): "
              + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in s["var"].items()))  # fmt: skip
        print("  cov: " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in s["cov"].items()))
        print("  M loss of the kept branch minus S2's pick's (nats): "
              + ", ".join(f"pick on {k} {v:+.4f}" for k, v in s["pick_vs_S2_on_M"].items()))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "summary": res}, f, indent=1)


if __name__ == "__main__":
    main()
