import json
import os
import subprocess
import sys
import warnings
from unittest.mock import Mock

import pytest

from hwtopo.testing import assert_fails, run_cli
from xronos.cli import main


def test_partition_command_prints_uneven_and_even(capsys):
    assert main(["partition", "--speeds", "1.0,0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sum(out["xronos"]["mlp_columns"]) == 1024 and out["even"]["mlp_columns"] == [512, 512]
    assert out["xronos"]["mlp_columns"][0] > out["xronos"]["mlp_columns"][1]
    assert out["predicted_speedup_vs_even"] > 1.0


def test_partition_from_hwtopo_cluster(capsys):
    assert main(["partition", "--cluster", "edge-home", "--heads", "8", "--kv-heads", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["xronos"]["q_heads"]) >= 2


# (argv with {tmp} for the test's directory, text the message must contain): each exits 2 before
# any work starts and creates nothing
BAD_INPUT = [
    ("partition --speeds 1,abc", "--speeds"),
    ("partition --speeds 1,1,1,1,1 --heads 8 --kv-heads 4", "cannot be split across 5 ranks"),
    ("partition --speeds 1,1 --memory 1KiB,1KiB", "rank 0 has 1024 bytes"),
    ("partition --batch 4", "--batch"),  # partition takes model options only
    ("partition --hidden 1e30", "--hidden"),
    ("partition --memory 1e400GiB,1MiB", "--memory"),
    ("bench --quick --cpu-share 0", "--cpu-share"),
    ("bench --quick --cpu-share lots", "--cpu-share"),
    ("bench --quick --steps 0 --quiet", "--steps"),
    ("bench --steps 99999999999", "--steps"),
    ("bench --lr nan", "--lr"),
    ("bench --quick --json {tmp}/no/r.json", "--json"),
    ("bench --quick --seeds 1,x", "--seeds"),
    ("bench --quick --seeds 1,1", "--seeds"),
    ("demo --steps 0 --quiet", "--steps"),
    ("demo --out {tmp}/a/b", "--out"),
    ("train --data /nonexistent/file.txt --steps 1", "--data"),
    ("train --ckpt-dir {tmp}/c/d", "--ckpt-dir"),
    ("train --save {tmp}/file", "--save"),
    ("train --seed -1", "--seed"),
    ("finetune", "--model"),
    ("finetune --model {tmp}/absent", "--model: model directory '{tmp}/absent' does not exist"),
    ("finetune --model {tmp}", "--model: {tmp} has no config.json; found: file"),
    ("finetune --model {tmp} --speeds 1,x", "--speeds"),
    ("finetune --model {tmp} --lora-r -1", "--lora-r"),
]


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """The test's directory with one file in it; a command that starts work fails (exit 1)."""
    import xronos.cli as cli
    import xronos.pretrained as pretrained
    import xronos.runner as runner

    started = Mock(side_effect=AssertionError("work started before the input was checked"))
    monkeypatch.setattr(cli, "_run_compare", started)
    monkeypatch.setattr(runner, "finetune", started)
    monkeypatch.setattr(pretrained, "finetune_pretrained", started)
    (tmp_path / "file").write_text("x")
    return tmp_path


@pytest.mark.parametrize("argv, needle", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_exits_2_before_any_work(argv, needle, tmp):
    assert_fails(main, argv, 2, needle, tmp=tmp, prog="xronos")


def test_usage_error_is_one_line():
    err = assert_fails(main, "partition --speeds 1,abc", 2, "--speeds").err.strip()
    assert err.startswith("xronos: error: --speeds") and "\n" not in err


def test_unexpected_error_is_one_line_exit_1(monkeypatch):
    import xronos.cli as cli

    monkeypatch.setattr(cli, "cmd_partition", Mock(side_effect=KeyError("rank3")))
    res = run_cli(cli.main, "partition")
    assert (res.code, res.err.strip()) == (1, "xronos: error: KeyError: 'rank3'")


@pytest.mark.slow
def test_torchrun_env_rendezvous_trains_like_the_reference(tmp_path):
    """`torchrun --nnodes=1` (static rendezvous through MASTER_ADDR/MASTER_PORT) runs `xronos train
    --torchrun` on 2 ranks; the eval loss equals a single-process run of the same steps."""
    from dist_helpers import small_cfg

    from hwtopo.launch import free_port
    from xronos.train import TPTrainer

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--node-rank=0"]
    cmd += ["--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "xronos", "train", "--torchrun"]
    cmd += ["--speeds", "1.0,1.0", "--steps", "2", "--ckpt-dir", str(tmp_path / "ck"), "--quiet", "--hidden", "64"]
    cmd += ["--layers", "2", "--heads", "8", "--kv-heads", "4", "--intermediate", "128", "--seq-len", "32"]
    cmd += ["--batch", "2", "--micro-batches", "2", "--vocab-parallel", "both"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0 and "SIGABRT" in proc.stderr:
        # Rank 1 aborted ("terminate called without an active exception") in CI rehearsals and in 2 of 20
        # runs under load: ranks exited with their gloo group alive. `xronos train --torchrun` now waits
        # for every rank and destroys the group (0 of 40 since); the retry stays as a guard that warns,
        # so a return shows in the test's warnings, and a second failure is a real one.
        warnings.warn(f"torchrun attempt 1 aborted, retrying; its stderr began: {proc.stderr[:3000]}", stacklevel=1)
        cmd = [f"--master-port={free_port()}" if c.startswith("--master-port=") else c for c in cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[:3000] + "\n...\n" + proc.stderr[-2000:]
    out = json.loads(proc.stdout[proc.stdout.index("{") :])
    cfg = small_cfg(steps=2, micro_batches=2, lr=3e-4, max_bytes=2_000_000, eval_batches=4)
    ref = TPTrainer(cfg, None)
    for _ in range(2):
        ref.step()
    assert out["eval_loss"] == pytest.approx(ref.evaluate(), rel=1e-5)
    assert sum(out["partition"]["q_heads"]) == 8


def test_cli_defaults_are_train_config_defaults():
    import dataclasses

    from xronos.cli import _cfg, build_parser
    from xronos.train import TrainConfig

    for cmd in (["bench"], ["train"], ["demo"]):
        cfg = _cfg(build_parser().parse_args(cmd))
        want = dataclasses.replace(TrainConfig(), steps=cfg.steps, lora_r=cfg.lora_r)
        assert cfg == want, cmd


def test_version_and_common_options_in_either_place(capsys):
    assert main(["--version"]) == 0
    assert f"xronos {__import__('xronos').__version__}" in capsys.readouterr().out
    assert main(["--quiet", "partition"]) == 0 and main(["partition", "--debug"]) == 0


def test_bench_reports_held_out_seeds_and_their_spread(tmp_path, monkeypatch):
    import json

    import xronos.cli as cli
    from xronos.bench import DEVELOPMENT_SEEDS, combine_seeds

    seen = []

    def fake_run(args, cfg, speeds, variants):
        seen.append(cfg.seed)
        head = {"emulation_valid": cfg.seed != 3, "step_time_ratio_vs_tp": 0.9 + 0.1 * cfg.seed / 2}
        summary = {"machine_load": {"emulated": "cgroup", "cpu_share": 1.0}}
        return [{"profile": {}}], summary, head, 1.0

    monkeypatch.setattr(cli, "_run_compare", fake_run)
    out = tmp_path / "b.json"
    assert main(["bench", "--json", str(out), "--quiet"]) == 0
    assert seen == [1, 2, 3] and not set(seen) & set(DEVELOPMENT_SEEDS)  # held out by default
    doc = json.loads(out.read_text())
    assert doc["config"]["seeds"]["reported"] == [1, 2, 3] and doc["config"]["seeds"]["held_out"] is True
    head = doc["headline"]
    assert head["emulation_valid"] is False  # one invalid seed makes the whole run invalid
    assert head["step_time_ratio_vs_tp"] == 1.0 and head["spread"]["step_time_ratio_vs_tp"] == pytest.approx(
        [0.95, 1.05]
    )
    assert head["flips_with_seed"] == ["step_time_ratio_vs_tp"]
    seen.clear()
    assert main(["bench", "--quick", "--seeds", "0", "--quiet"]) == 0
    assert seen == [0]
    assert combine_seeds({5: {"x": 1.0}}) == {"x": 1.0, "seeds": [5]}


def test_bench_table_lists_variants_only():
    from xronos.cli import _rows

    variant = {"step_time_s": 0.5, "eval_loss": 2.0, "partition": {"q_heads": [12, 4], "mlp_columns": [768, 256]}}
    summary = {
        "xronos": variant,
        "reference": {"step_time_s": 0.7, "eval_loss": 2.0},
        "machine_load": {"emulated": "cgroup"},
        "emulation": {"valid": True},
        "free_comm_bound": {"step_time_s": 0.4, "ratio_vs_fast_alone": 0.6},
    }
    rows = _rows(summary)
    assert [r["variant"] for r in rows] == ["xronos", "reference"]
    assert rows[0]["shards / stages"] == "heads [12, 4] mlp [768, 256]" and rows[1]["step time (s)"] == "0.700"


def test_demo_report_says_when_the_emulation_missed_its_speeds():
    from xronos.cli import _demo_report
    from xronos.train import TrainConfig

    check = {"achieved_relative_speeds": [1.0, 0.8], "requested_relative_speeds": [1.0, 0.5], "invalid_ranks": [1]}
    summary = {
        "machine_load": {"emulated": "cgroup"},
        "emulation": {
            "valid": False,
            "tolerance": 0.1,
            "checks": {"kernel": check},
            "invalid_because": ["kernel: rank 1 ran at 0.80 of the fastest, asked 0.50"],
        },
    }
    head = {"emulation_valid": False, "achieved_relative_speeds": [1.0, 0.8], "step_time_ratio_vs_tp": 0.71234}
    text = _demo_report(TrainConfig(), [1.0, 0.5], summary, head, [], False)
    assert "`emulation_valid` = False" in text and "`achieved_relative_speeds` = [1, 0.8]" in text
    assert "`step_time_ratio_vs_tp` = 0.7123" in text
    assert "INVALID RUN" in text and "rank 1 ran at 0.80" in text
