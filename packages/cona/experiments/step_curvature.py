"""Samples each global batch needs from a checkpoint (from scratch included), and whether a one-step
curvature term added to the square-root efficiency model predicts them.

For each seed and checkpoint (samples trained at gb64; 0 = the untrained model): take gb64's next AdamW
update direction u (clipped gradient folded into the moments, bias corrected), evaluate the loss of a fixed
held-out batch at theta - s u for step sizes s of 0, 0.5, 1, 2 and 4 times gb64's learning rate (four draws
of the batch u is taken from), and fit L(s) = L0 - alpha s + beta s^2 (alpha: first-order progress per unit
step, beta: its curvature cost). Predicted per-step progress of batch M under the square-root rule
lr_M = lr0 sqrt(M / M0) is alpha lr_M a_M / a_64 - beta lr_M^2 (a_M = 1 / sqrt(1 + phi / M), phi the
preconditioned noise scale), per sample divided by M; printed with the plain square-root model's prediction
beside the samples each batch needs, branched from the checkpoint, to four loss levels all branches reach
(as ``batch_efficiency.py``). The README's "Step 0" figures come from:

    python experiments/step_curvature.py --seeds 0 --checkpoints 0,512 --horizon 4096 --json a.json
    python experiments/step_curvature.py --seeds 0 --checkpoints 4096,12288 --horizon 4096 --json b.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math

import numpy as np
import torch
from batch_efficiency import (  # same directory
    adam,
    branch_curve,
    ce,
    grad_pair,
    lr_for,
    samples_to,
    train_to,
    val_loss,
)

from cona.gns import unbiased_estimates
from cona.model import TextData, stdlib_tokens, tiny_llama_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--checkpoints", default="0,512,4096")
    ap.add_argument("--horizon", type=int, default=8192)
    ap.add_argument("--every", type=int, default=512)
    ap.add_argument("--branches", default="32,64,128,256")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = tiny_llama_config(2, 32, 4, 2, 96)
    tokens = stdlib_tokens(1_000_000)
    out = []
    for seed in map(int, args.seeds.split(",")):
        for ck in map(int, args.checkpoints.split(",")):
            out.append(one(cfg, tokens, seed, ck, args))
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


def one(cfg, tokens, seed, checkpoint, args):
    data = TextData(tokens, 32, seed)
    val = data.validation(256)

    def loss(m, v=val):
        return val_loss(m, v)

    model, opt, used = train_to(cfg, data, seed, checkpoint)
    ps = list(model.parameters())
    # noise scale in Adam's metric (as the bench: v floored at 1% of its tensor's mean; before any step g^2)
    if opt.state:
        bc = 1 - 0.95 ** float(opt.state[ps[0]]["step"])
        v = [opt.state[p]["exp_avg_sq"] / bc for p in ps]
    else:
        for p in ps:
            p.grad = None
        ce(model, data.samples(used, 64)).backward()
        v = [p.grad.pow(2) for p in ps]
    pre = [1.0 / (x.clamp(min=0.01 * float(x.mean())).sqrt() + 1e-8) for x in v]
    pairs = []
    for k in range(12):
        gs, big = grad_pair(model, data, k)
        sq = lambda grads: sum(float((g * w).double().pow(2).sum()) for g, w in zip(grads, pre))  # noqa: E731
        pairs.append(unbiased_estimates(sum(sq(g) for g in gs) / len(gs), 16, sq(big), 256))
    phi = sum(s for _, s in pairs) / sum(g for g, _ in pairs)
    # line probes along gb64's next update, several draws of the batch
    probe_val = data.samples(2 * 10**6, 256)
    lr0 = lr_for(64)
    fits = []
    for draw in range(4):
        m = copy.deepcopy(model)
        o = adam(m.parameters(), lr0)
        o.load_state_dict(opt.state_dict())
        for g in o.param_groups:
            g["lr"] = lr0
        theta = [p.detach().clone() for p in m.parameters()]
        o.zero_grad()
        ce(m, data.samples(3 * 10**6 + 64 * draw, 64)).backward()
        torch.nn.utils.clip_grad_norm_(list(m.parameters()), 1.0)
        o.step()
        u = [(t - p.detach()) / lr0 for t, p in zip(theta, m.parameters())]  # the update per unit lr
        pts = []
        for mult in (0.0, 0.5, 1.0, 2.0, 4.0):
            with torch.no_grad():
                for p, t, d in zip(m.parameters(), theta, u):
                    p.copy_(t - mult * lr0 * d)
            pts.append((mult * lr0, loss(m, probe_val)))
        # least squares L = L0 - a s + b s^2
        S = np.array([[1, -s, s * s] for s, _ in pts])
        y = np.array([v for _, v in pts])
        c = np.linalg.lstsq(S, y, rcond=None)[0]
        fits.append({"alpha": float(c[1]), "beta": float(c[2]), "points": pts})
    alpha = sum(f["alpha"] for f in fits) / len(fits)
    beta = sum(f["beta"] for f in fits) / len(fits)
    l0 = loss(model)
    print(
        f"seed {seed} ckpt {used}: ppl {math.exp(l0):.2f} phi {phi:.1f} alpha {alpha:.3g} beta {beta:.3g} "
        f"lr*={alpha / (2 * beta) if beta > 0 else math.inf:.3g} (lr64 {lr0:.3g})",
        flush=True,
    )
    for f in fits:
        print("   draw", [f"{s:.4f}:{v:.4f}" for s, v in f["points"]], f"a={f['alpha']:.3g} b={f['beta']:.3g}")

    def pred(gb, curv):
        lr = lr_for(gb)
        a = 1 / math.sqrt(1 + phi / gb)
        a64 = 1 / math.sqrt(1 + phi / 64)
        first = alpha * lr * a / a64
        second = beta * lr * lr if curv else 0.0
        return (first - second) / gb

    res = {"seed": seed, "ckpt": used, "phi": phi, "alpha": alpha, "beta": beta, "fits": fits, "branches": {}}
    for spec in args.branches.split(","):
        gb = int(spec)
        curve = branch_curve(model, opt, data, used, gb, lr_for(gb), args.horizon, args.every, loss, l0)
        res["branches"][gb] = curve
    br = res["branches"]
    worst = max(min(v for _, v in c[1:]) for c in br.values())
    levels = [l0 - (l0 - worst) * (i + 1) / 4 for i in range(4)]
    for gb, c in br.items():
        meas = [samples_to(c, lv) / samples_to(br[64], lv) for lv in levels]
        p0 = pred(64, False) / pred(gb, False)
        p1 = pred(64, True) / pred(gb, True) if pred(gb, True) > 0 else math.inf
        print(
            f"  gb{gb}: measured samples vs gb64 "
            + ", ".join(f"{x:.2f}" for x in meas)
            + f" | sqrt {p0:.2f} | sqrt+curvature {p1:.2f}",
            flush=True,
        )
    return res


if __name__ == "__main__":
    main()
