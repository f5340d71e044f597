"""How well the step-0 noise-scale range covers the noise scale at the initial weights, and how wide it is, for the
two ways of measuring it: three (micro-batch, global batch) pairs, one per gb64 batch (the first micro-batch of each
data-parallel rank against the whole batch, as 4 ranks of dp4-mb8-gb64 read them; cona's scheme until 2026-12-02,
which on 2 ranks, dp2-mb8-gb64, read 2 of the 8 per pair and was weaker still),
and a jackknife over the 8 micro-batches of one gb64 batch or of two (``gns.micro_batch_pairs``, the scheme since).

One process per seed: the bench's model, data and initial weights; the metric is Adam's stand-in at step 0 (the
squared gradient of one warm gb64 batch, floored per tensor as the executor floors it). The "truth" a range is held
against is the jackknife's point estimate over every micro-batch of the other ``--batches`` gb64 batches (those the
range did not read); each range is Fieller's set at the two-sided 95% Student-t quantile for its pairs. The README's "Step 0" figures come from:

    python experiments/step0_range.py --seeds 0-7 --batches 12
"""

from __future__ import annotations

import argparse

import torch

from cona.executor import V_FLOOR
from cona.gns import fieller_interval, micro_batch_pairs, unbiased_estimates
from cona.model import TextData, build_model, stdlib_tokens, tiny_llama_config

GB, MB, EPS = 64, 8, 1e-8


def grads(model, ids: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad.detach().double().clone() for p in model.parameters()]


def dot(a: list[torch.Tensor], b: list[torch.Tensor], w2: list[torch.Tensor]) -> float:
    return float(sum((x * w * y).sum() for x, y, w in zip(a, b, w2)))


def jackknife(mbs: list[list[torch.Tensor]], w2: list[torch.Tensor]) -> list[tuple[float, float]]:
    mean = [sum(t) / len(mbs) for t in zip(*mbs)]
    return micro_batch_pairs([dot(g, g, w2) for g in mbs], [dot(g, mean, w2) for g in mbs], dot(mean, mean, w2), MB)


def noise_scale(pairs: list[tuple[float, float]]) -> float:
    g2, tr = (sum(x) / len(pairs) for x in zip(*pairs))
    return tr / g2


def summary(ranges: list[tuple[float, float]], truths: list[float]) -> str:
    widths = sorted(hi / max(lo, 1e-9) for lo, hi in ranges)
    covered = sum(lo <= t <= hi for (lo, hi), t in zip(ranges, truths))
    return f"covers {covered}/{len(ranges)}, median hi/lo {widths[len(widths) // 2]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-7", help="a range a-b or a comma list")
    ap.add_argument("--batches", type=int, default=12, help="gb64 batches per seed (a multiple of 6)")
    args = ap.parse_args()
    if args.batches < 6 or args.batches % 6:
        raise SystemExit(f"--batches must be a positive multiple of 6, got {args.batches}")
    a, _, b = args.seeds.partition("-")
    seeds = range(int(a), int(b) + 1) if b else [int(x) for x in args.seeds.split(",")]
    toks, cfg = stdlib_tokens(1_000_000), tiny_llama_config(2, 32, 4, 2, 96)
    for seed in seeds:
        model, data = build_model(cfg, seed), TextData(toks, 32, seed)
        w2 = []
        for g in grads(model, data.samples(0, GB)):  # the warm batch: Adam's v stand-in, floored per tensor
            v = g.pow(2)
            w2.append((v.clamp(min=V_FLOOR * float(v.mean())).sqrt() + EPS).pow(-2))
        batches = []
        for k in range(1, args.batches + 1):
            ids = data.samples(k * GB, GB)
            batches.append([grads(model, ids[i * MB : (i + 1) * MB]) for i in range(GB // MB)])
        every = [m for b in batches for m in b]

        def truth(first: int, count: int, every=every, w2=w2) -> float:  # over the batches the range did not read
            return noise_scale(jackknife(every[: first * (GB // MB)] + every[(first + count) * (GB // MB) :], w2))

        one = [fieller_interval(jackknife(b, w2)) for b in batches]
        two = [fieller_interval(jackknife(batches[i] + batches[i + 1], w2)) for i in range(0, len(batches), 2)]
        old = []
        for b in batches:
            mean = [sum(t) / len(b) for t in zip(*b)]
            small = sum(dot(b[i], b[i], w2) for i in range(0, len(b), 2)) / (len(b) // 2)  # rank's first micro-batch
            old.append(unbiased_estimates(small, MB, dot(mean, mean, w2), GB))
        three = [fieller_interval(old[i : i + 3]) for i in range(0, len(old), 3)]
        print(f"seed {seed}: noise scale {noise_scale(jackknife(every, w2)):.1f} (all {len(every)} micro-batches) | "
              f"1 batch: {summary(one, [truth(i, 1) for i in range(len(batches))])} | "
              f"2 batches: {summary(two, [truth(i, 2) for i in range(0, len(batches), 2)])} | "
              f"3 pairs: {summary(three, [truth(i, 3) for i in range(0, len(batches), 3)])}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
