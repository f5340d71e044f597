import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def state_digest(state) -> float:
    """A checksum of a FullState (in a fixed order, so a checkpoint round trip reads the same); the tests' spawned
    workers import it from here."""
    tensors = state.tensors
    return sum(float(tensors[k][n].double().sum()) for k in sorted(tensors) for n in sorted(tensors[k])) + state.step


def expected_models(decisions) -> list[str]:
    """The efficiency models each running decision must have held under: both (``sqrt+tuned``) until the noise
    scale's growth has first been fitted, ``sqrt`` from that decision on (a latch: a later failed fit keeps it)."""
    fitted, out = False, []
    for d in decisions:
        fitted = fitted or d.get("noise_growth") is not None
        out.append("sqrt" if fitted else "sqrt+tuned")
    return out


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process tests (still run in nox -s tests)")


def _micro_reference(ids, micro_batch, warm=None, eps=1e-4):
    """(sorted (|g_k|^2, g_k . S) over the micro-batches of ``ids``, |S|^2) from each micro-batch's own gradient on
    one process (``build_model(tiny_llama_config(), 0)``); with ``warm`` (a batch) in Adam's step-0 metric, v the
    squared gradient of ``warm`` floored at V_FLOOR x its tensor's mean, as ``Executor.micro_batch_stats`` takes it."""
    from cona.executor import V_FLOOR
    from cona.model import build_model, tiny_llama_config

    model = build_model(tiny_llama_config(), 0)

    def grad(x):
        model.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        return [p.grad.double().clone() for p in model.parameters()]

    w2 = [torch.ones((), dtype=torch.float64)] * len(list(model.parameters()))
    if warm is not None:
        w2 = [1.0 / (g.pow(2).clamp(min=V_FLOOR * float(g.pow(2).mean())).sqrt() + eps) ** 2 for g in grad(warm)]
    grads = [grad(ids[k : k + micro_batch]) for k in range(0, len(ids), micro_batch)]
    mean = [sum(gs) / len(grads) for gs in zip(*grads)]

    def dot(a, c):
        return float(sum((x * w * y).sum() for x, y, w in zip(a, c, w2)))

    return sorted((dot(g, g), dot(g, mean)) for g in grads), dot(mean, mean)


@pytest.fixture
def micro_reference():
    return _micro_reference
