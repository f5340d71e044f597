import pytest

import hwtopo
from cona.cli import main
from cona.simulate import PAPER_MODELS, simulate_step
from cona.space import Strategy, StrategyError

NODE = hwtopo.load("gpu-node-8")
GPT = PAPER_MODELS["gpt3-1.3b"]


def test_compute_scales_with_batch_and_comm_with_degree():
    a = simulate_step(Strategy(8, 1, 1, 4, 64), GPT, NODE)
    b = simulate_step(Strategy(8, 1, 1, 4, 128), GPT, NODE)
    assert b.compute_s == pytest.approx(2 * a.compute_s)  # twice the tokens, same ranks
    assert a.dp_comm_s == pytest.approx(b.dp_comm_s)  # one gradient all-reduce either way
    tp = simulate_step(Strategy(1, 8, 1, 4, 64), GPT, NODE)
    assert tp.tp_comm_s > 0 and tp.dp_comm_s == 0 and a.tp_comm_s == 0
    pp = simulate_step(Strategy(1, 1, 8, 4, 64), GPT, NODE)
    assert pp.compute_s > a.compute_s  # the GPipe bubble: (16 + 7) / 16
    assert pp.compute_s == pytest.approx(a.compute_s * 23 / 16)


def test_simulate_rejects_mismatched_world_and_cli_lists(capsys):
    with pytest.raises(StrategyError, match="world has 8 ranks"):
        simulate_step(Strategy(2, 1, 1, 4, 64), GPT, NODE)
    assert main(["simulate", "--model", "llama-3.2-1b", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "simulated (not measured)" in out and len(out.strip().splitlines()) == 4
    assert main(["simulate", "--model", "gpt-5"]) == 2
