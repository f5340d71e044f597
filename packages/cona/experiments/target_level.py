"""How the measuring set's size moves the validation level and its wiggle, and which target on a larger set
marks the same training progress as a target on a smaller one.

Trains the bench's model at global batch 64 (its learning rate, clipping and sample stream; one process) and
evaluates two evenly spaced sets of validation windows every ``--every`` steps (4 steps of gb64 is ~0.1 s of the
4-rank bench's clock, its evaluation spacing). For each seed it reports, at the first evaluation where the
smaller set's mean of the last 5 reaches ``--target`` perplexity, the larger set's mean of the last 5 (the
perplexity that marks the same progress there), and each set's deviation from its own trend (a centred moving
average of 9 evaluations) with the correlation between the two sets' deviations: what a bigger set averages out.

    python experiments/target_level.py --seeds 0-3 --small 128 --large 512 --target 6.5 --json /tmp/level.json
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch
from batch_efficiency import adam, lr_for, step, val_loss  # same directory
from held_out_overlap import _ints as seeds_arg  # "0-3" or "0,5" (same directory)

from cona.model import TextData, build_model, stdlib_tokens, tiny_llama_config


def trailing(xs: list[float], w: int = 5) -> list[float]:
    return [float(np.mean(xs[max(0, i + 1 - w) : i + 1])) for i in range(len(xs))]


def wiggle(xs: np.ndarray, k: int = 9) -> np.ndarray:
    """Deviation from a centred moving average of ``k`` (the ends dropped)."""
    sm = np.convolve(xs, np.ones(k) / k, mode="valid")
    return xs[k // 2 : k // 2 + len(sm)] - sm


def one(cfg, tokens, seed: int, args) -> dict:
    data = TextData(tokens, 32, seed, held_out_tokens=args.held_out_bytes)  # the bench's splits and stream
    small, large = data.validation(args.small), data.validation(args.large)
    model = build_model(cfg, seed)
    opt = adam(model.parameters(), lr_for(64))
    target = math.log(args.target)
    ls, ll, hit, stop = [], [], None, args.steps
    for k in range(args.steps):
        step(model, opt, data.samples(k * 64, 64))
        if (k + 1) % args.every == 0:
            ls.append(val_loss(model, small))
            ll.append(val_loss(model, large))
            if hit is None and len(ls) >= 5 and trailing(ls)[-1] <= target:
                hit = len(ls) - 1
                stop = k + 1 + args.after_steps
            if hit is not None and k + 1 >= stop:
                break
    if hit is None:
        raise SystemExit(f"seed {seed}: the {args.small}-window set never reached perplexity {args.target} in "
                         f"{args.steps} steps (raise --steps)")  # fmt: skip
    a, b = np.array(ls), np.array(ll)
    lo = len(a) // 2  # the later half: near the target, where time to target is read
    if len(a) - lo < 11:
        raise SystemExit(f"seed {seed}: {len(a) - lo} evaluations in the later half, too few for a 9-wide trend "
                         f"(raise --after-steps or lower --every)")  # fmt: skip
    wa, wb = wiggle(a[lo:]), wiggle(b[lo:])
    large_at = trailing(ll)[hit]
    return {"seed": seed, "samples_at_hit": (hit + 1) * args.every * 64,
            "small_mean5_at_hit": trailing(ls)[hit], "large_mean5_at_hit": large_at,
            "large_ppl_at_hit": math.exp(large_at), "level_offset": trailing(ls)[hit] - large_at,
            "wiggle_sd_small": float(wa.std()), "wiggle_sd_large": float(wb.std()),
            "wiggle_corr": float(np.corrcoef(wa, wb)[0, 1])}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0-3")
    ap.add_argument("--small", type=int, default=128)
    ap.add_argument("--large", type=int, default=512)
    ap.add_argument("--target", type=float, default=6.5)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--after-steps", type=int, default=40)
    ap.add_argument("--corpus-bytes", type=int, default=1_000_000)
    ap.add_argument("--held-out-bytes", type=int, default=300_000)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = tiny_llama_config(2, 32, 4, 2, 96)
    tokens = stdlib_tokens(args.corpus_bytes + args.held_out_bytes)
    out = []
    for seed in seeds_arg(args.seeds):
        r = one(cfg, tokens, seed, args)
        out.append(r)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    ppl = [r["large_ppl_at_hit"] for r in out]
    print(f"{args.large} windows at the point the {args.small} reach perplexity {args.target}: median "
          f"{float(np.median(ppl)):.3f} (range {min(ppl):.3f}..{max(ppl):.3f}); wiggle sd median "
          f"{float(np.median([r['wiggle_sd_small'] for r in out])):.4f} -> "
          f"{float(np.median([r['wiggle_sd_large'] for r in out])):.4f} nats")  # fmt: skip
    if args.json:
        from hwtopo import atomic_write_text

        atomic_write_text(args.json, json.dumps({"args": vars(args), "seeds": out}, indent=1))


if __name__ == "__main__":
    main()
