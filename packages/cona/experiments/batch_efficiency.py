"""Measured batch-size efficiency from one checkpoint against what cona's efficiency models predict.

One process, one thread, the bench's model, data, learning-rate rule (square root from the reference batch 8),
clipping and AdamW settings. For every seed (init and data order) and checkpoint it trains global batch 64 to the
checkpoint, measures the gradient noise scale there (plain and Adam-preconditioned, from many micro-batch / batch
pairs), then branches each requested batch (optionally at a multiple of its learning rate, ``64x2``) from the same
weights and Adam state and evaluates the validation loss every ``--every`` samples. For loss levels every branch
reaches it counts the samples each batch needs relative to gb64 and sets them against the ratios
``cona.gns.batch_efficiency`` predicts from the measured preconditioned noise scale: "sqrt" (Adam under the
square-root rule the bench trains with, cona's model) and "tuned" (Pollux, LR tuned per batch). Samples, not time:

    python experiments/batch_efficiency.py --seeds 0,1,2 --checkpoints 512,4096,16384 --horizon 8192 \
        --branches 32,64,128,256 --json /tmp/cona-eff.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math

import torch
import torch.nn.functional as F

from cona.gns import batch_efficiency, unbiased_estimates
from cona.model import TextData, build_model, stdlib_tokens, tiny_llama_config


def ce(m, ids: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy of a causal LM on a batch of windows (the bench's loss)."""
    lg = m(ids).logits
    return F.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1))


def val_loss(m, windows: torch.Tensor) -> float:
    """Mean loss over ``windows``, 64 at a time, without gradients."""
    with torch.no_grad():
        return float(sum(ce(m, v) * v.shape[0] for v in windows.split(64)) / windows.shape[0])


def adam(params, lr: float) -> torch.optim.AdamW:
    """The bench's AdamW (betas 0.9 / 0.95, no weight decay)."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=False)


def lr_for(gb: int) -> float:
    """The bench's square-root rule from the reference batch 8."""
    return 2e-3 * math.sqrt(gb / 8)


def step(m, opt, batch: torch.Tensor) -> None:
    """One training step as the bench takes it (global-norm clipping at 1.0)."""
    opt.zero_grad()
    ce(m, batch).backward()
    torch.nn.utils.clip_grad_norm_(list(m.parameters()), 1.0)
    opt.step()


def train_to(cfg, data, seed: int, checkpoint: int):
    """(model, AdamW, samples read) of the bench's model trained at global batch 64 to ``checkpoint`` samples."""
    model = build_model(cfg, seed)
    opt = adam(model.parameters(), lr_for(64))
    used = 0
    while used < checkpoint:
        step(model, opt, data.samples(used, 64))
        used += 64
    return model, opt, used


def grad_pair(model, data, k: int) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """The k-th (16, 256) gradient pair: the 16 micro-batch gradients of 16 windows and their mean (the
    256-window gradient), from samples far beyond those training reads."""
    ps = list(model.parameters())
    gs = []
    for mb in data.samples(10**6 + 256 * k, 256).split(16):
        for p in ps:
            p.grad = None
        ce(model, mb).backward()
        gs.append([p.grad.clone() for p in ps])
    return gs, [sum(g[i] for g in gs) / len(gs) for i in range(len(ps))]


def branch_curve(model, opt, data, used: int, gb: int, lr: float, horizon: int, every: int, loss, l0: float):
    """Branch a copy of ``model`` (and of ``opt``'s state when it has any) at batch ``gb`` and learning rate
    ``lr`` from sample ``used``: [(samples since the branch, validation loss)] every ``every`` samples."""
    m = copy.deepcopy(model)
    o = adam(m.parameters(), lr)
    if opt.state:
        o.load_state_dict(opt.state_dict())
    for g in o.param_groups:
        g["lr"] = lr
    curve, u = [(0, l0)], 0
    while u < horizon:
        step(m, o, data.samples(used + u, gb))
        u += gb
        if u % every == 0:
            curve.append((u, loss(m)))
    return curve


def samples_to(curve: list[tuple[int, float]], level: float) -> float | None:
    """First sample count at which the loss curve reaches ``level`` (linear between evaluations)."""
    for (u0, v0), (u1, v1) in zip(curve, curve[1:]):
        if v1 <= level:
            return u1 if v0 <= level or v0 == v1 else u0 + (u1 - u0) * (v0 - level) / (v0 - v1)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0", help="init / data-order seeds, comma separated")
    ap.add_argument("--checkpoints", default="16384", help="samples trained at batch 64 before branching")
    ap.add_argument("--horizon", type=int, default=16384, help="samples per branch")
    ap.add_argument("--every", type=int, default=1024, help="evaluate every this many samples")
    ap.add_argument("--branches", default="32,64,128,256", help="batch[xLR multiple], comma separated")
    ap.add_argument("--val", type=int, default=256, help="validation windows")
    ap.add_argument("--pairs", type=int, default=24, help="(16, 256) gradient pairs for the noise scale")
    ap.add_argument("--levels", type=int, default=4, help="loss levels compared per checkpoint")
    ap.add_argument("--json", help="write the curves and ratios here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = tiny_llama_config(2, 32, 4, 2, 96)
    tokens = stdlib_tokens(1_000_000)
    out: dict = {"runs": []}
    for seed in [int(x) for x in args.seeds.split(",")]:
        for ckpt in [int(x) for x in args.checkpoints.split(",")]:
            r = one(cfg, tokens, seed, ckpt, args)
            out["runs"].append(r)
    summarize(out, args.levels)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def one(cfg, tokens, seed: int, checkpoint: int, args) -> dict:
    data = TextData(tokens, 32, seed)
    val = data.validation(args.val)

    def loss(m) -> float:
        return val_loss(m, val)

    model, opt, used = train_to(cfg, data, seed, checkpoint)
    # noise scale at the checkpoint: plain and in Adam's metric g / (sqrt(v_hat) + eps), v floored as cona does
    ps = list(model.parameters())
    bc = 1 - 0.95 ** float(opt.state[ps[0]]["step"])
    v = [opt.state[p]["exp_avg_sq"] / bc for p in ps]
    pre = [1.0 / (x.clamp(min=0.01 * float(x.mean())).sqrt() + 1e-8) for x in v]
    est: dict[str, list[tuple[float, float]]] = {"plain": [], "preconditioned": []}

    def sq(grads, w) -> float:
        """Squared norm of the gradient in the metric ``w``."""
        return sum(float((g * x).double().pow(2).sum()) for g, x in zip(grads, w))

    for k in range(args.pairs):
        gs, big = grad_pair(model, data, k)
        for kind, w in (("plain", [1.0] * len(ps)), ("preconditioned", pre)):
            small = sum(sq(g, w) for g in gs) / len(gs)
            est[kind].append(unbiased_estimates(small, 16, sq(big, w), 256))
    for p in ps:
        p.grad = None
    phi = {k: sum(s for _, s in e) / sum(g for g, _ in e) for k, e in est.items()}
    l0 = loss(model)
    r = {"seed": seed, "checkpoint_samples": used, "checkpoint_loss": l0, "noise_scale": phi, "branches": {}}
    print(f"seed {seed} checkpoint {used} samples, perplexity {math.exp(l0):.3f}, noise scale {phi}", flush=True)
    for spec in args.branches.split(","):
        gb_text, _, mult_text = spec.partition("x")
        gb, mult = int(gb_text), float(mult_text or 1)
        curve = branch_curve(model, opt, data, used, gb, lr_for(gb) * mult, args.horizon, args.every, loss, l0)
        r["branches"][spec] = curve
        print(
            f"  batch {gb} lr x{mult:g}: " + ", ".join(f"+{a}: {math.exp(b):.3f}" for a, b in curve[1::4]), flush=True
        )
    return r


def summarize(out: dict, n_levels: int) -> None:
    """Samples each batch needs relative to gb64 at loss levels all branches reach, against both models."""
    for r in out["runs"]:
        br = {k: v for k, v in r["branches"].items() if "x" not in k}
        if "64" not in br:
            continue
        worst = max(min(v for _, v in c[1:]) for c in br.values())  # the level every branch reaches
        l0 = r["checkpoint_loss"]
        levels = [l0 - (l0 - worst) * (i + 1) / n_levels for i in range(n_levels)]
        phi = r["noise_scale"]["preconditioned"]
        r["ratios"] = {}
        for k, c in br.items():
            gb = int(k)
            meas = [samples_to(c, lv) / samples_to(br["64"], lv) for lv in levels]
            pred = {m: batch_efficiency(64, phi, 8, m) / batch_efficiency(gb, phi, 8, m) for m in ("tuned", "sqrt")}
            r["ratios"][k] = {"measured": meas, "predicted": pred}
        shown = ", ".join(f"{math.exp(x):.2f}" for x in levels)
        print(
            f"seed {r['seed']} ckpt {r['checkpoint_samples']} (ppl {math.exp(l0):.2f}, preconditioned phi {phi:.0f}):"
        )
        print(f"  samples vs gb64 at ppl {shown}")
        for k, q in r["ratios"].items():
            measured = ", ".join(f"{x:.2f}" for x in q["measured"])
            pred = q["predicted"]
            print(f"  gb{k}: measured {measured} | tuned {pred['tuned']:.2f}, sqrt {pred['sqrt']:.2f}")
    # log error of each model over every (run, batch, level)
    err: dict[str, list[float]] = {"tuned": [], "sqrt": []}
    for r in out["runs"]:
        for k, q in r.get("ratios", {}).items():
            if k == "64":
                continue
            m = sum(math.log(x) for x in q["measured"]) / len(q["measured"])
            for name in err:
                err[name].append(abs(math.log(q["predicted"][name]) - m))
    out["mean_abs_log_error"] = {k: sum(v) / len(v) for k, v in err.items() if v}
    print("mean |log(predicted / measured)| over runs and batches:", out["mean_abs_log_error"], flush=True)


if __name__ == "__main__":
    main()
