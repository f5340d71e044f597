"""Measured batch-size efficiency from one checkpoint vs what the noise-scale model predicts.

One process, one thread, the bench's model, data, learning-rate rule (square root from the reference
batch 8), clipping and AdamW settings. Trains global batch 64 to a checkpoint, measures the gradient
noise scale there (plain and Adam-preconditioned, from many micro-batch / batch pairs), then branches
each requested batch (optionally at a multiple of its learning rate, ``64x2``) from the same weights and
Adam state and prints the validation perplexity every 4096 samples. The README's "why no switch" figures
come from this script:

    python experiments/batch_efficiency.py --checkpoint 16384 --horizon 16384 --branches 64,128,256,64x2,64x0.5
"""

from __future__ import annotations

import argparse
import copy
import json
import math

import torch
import torch.nn.functional as F

from cona.gns import unbiased_estimates
from cona.model import TextData, build_model, stdlib_tokens, tiny_llama_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=int, default=16384, help="samples trained at batch 64 before branching")
    ap.add_argument("--horizon", type=int, default=16384, help="samples per branch")
    ap.add_argument("--branches", default="64,128,256,64x2,64x0.5", help="batch[xLR multiple], comma separated")
    ap.add_argument("--val", type=int, default=512, help="validation windows")
    ap.add_argument("--pairs", type=int, default=24, help="(16, 256) gradient pairs for the noise scale")
    ap.add_argument("--json", help="write the curves here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = tiny_llama_config(2, 32, 4, 2, 96)
    data = TextData(stdlib_tokens(1_000_000), 32, 0)
    val = data.validation(args.val)

    def ce(m, ids):
        lg = m(ids).logits
        return F.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1))

    def ppl(m) -> float:
        with torch.no_grad():
            return math.exp(float(sum(ce(m, v) * v.shape[0] for v in val.split(32)) / val.shape[0]))

    def adam(params, lr):
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=False)

    def lr_for(gb: int) -> float:
        return 2e-3 * math.sqrt(gb / 8)

    def step(m, opt, batch) -> None:
        opt.zero_grad()
        ce(m, batch).backward()
        torch.nn.utils.clip_grad_norm_(list(m.parameters()), 1.0)
        opt.step()

    model = build_model(cfg, 0)
    opt = adam(model.parameters(), lr_for(64))
    used = 0
    while used < args.checkpoint:
        step(model, opt, data.samples(used, 64))
        used += 64
    # noise scale at the checkpoint: plain and in Adam's metric g / (sqrt(v_hat) + eps), v floored as cona does
    ps = list(model.parameters())
    bc = 1 - 0.95 ** float(opt.state[ps[0]]["step"])
    v = [opt.state[p]["exp_avg_sq"] / bc for p in ps]
    pre = [1.0 / (x.clamp(min=0.01 * float(x.mean())).sqrt() + 1e-8) for x in v]
    est: dict[str, list[tuple[float, float]]] = {"plain": [], "preconditioned": []}

    def sq(grads, w) -> float:
        return sum(float((g * x).double().pow(2).sum()) for g, x in zip(grads, w))

    for k in range(args.pairs):
        gs = []
        for mb in data.samples(10**6 + 256 * k, 256).split(16):
            for p in ps:
                p.grad = None
            ce(model, mb).backward()
            gs.append([p.grad.clone() for p in ps])
        big = [sum(g[i] for g in gs) / len(gs) for i in range(len(ps))]
        for kind, w in (("plain", [1.0] * len(ps)), ("preconditioned", pre)):
            est[kind].append(unbiased_estimates(sum(sq(g, w) for g in gs) / len(gs), 16, sq(big, w), 256))
    for p in ps:
        p.grad = None
    phi = {k: sum(s for _, s in e) / sum(g for g, _ in e) for k, e in est.items()}
    out = {"checkpoint_samples": used, "checkpoint_ppl": ppl(model), "noise_scale": phi, "branches": {}}
    print(f"checkpoint {used} samples, perplexity {out['checkpoint_ppl']:.3f}, noise scale {phi}", flush=True)
    for spec in args.branches.split(","):
        gb_text, _, mult_text = spec.partition("x")
        gb, mult = int(gb_text), float(mult_text or 1)
        m = copy.deepcopy(model)
        o = adam(m.parameters(), lr_for(gb) * mult)
        o.load_state_dict(opt.state_dict())
        for g in o.param_groups:
            g["lr"] = lr_for(gb) * mult
        curve, u = [], 0
        while u < args.horizon:
            step(m, o, data.samples(used + u, gb))
            u += gb
            if u % 4096 == 0:
                curve.append((u, ppl(m)))
        out["branches"][spec] = curve
        print(f"  batch {gb} lr x{mult:g}: " + ", ".join(f"+{a}: {b:.3f}" for a, b in curve), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
