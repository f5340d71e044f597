"""The fault and attack sweep of every mlsyskit package: counts of what a user must never see.

    python tests-integration/safety.py --json bench-output/safety.json [--only kvpool,xronos]

Each count is measured by running the attack, never by reading the code:

- ``cli``: malformed command lines (out-of-range numbers, nan/inf, unwritable or missing paths,
  binary and non-UTF-8 files, pickles where a spec goes, unknown commands) through each console
  script's ``main(argv)`` in this process, stderr captured at the file descriptor, under an alarm.
  Bad: ``tracebacks`` (stderr holds one), ``bad_exit`` (exit code other than 1 or 2, 0 included:
  every input is malformed), ``slow`` (the alarm fired: work started before the input was checked),
  ``created`` (a directory appeared outside the path the user named), ``code_executed``.
- ``loaders``: every loader that reads a user's path gets a crafted pickle whose unpickling
  creates a marker file. Bad: ``code_executed``. (An exception is a good outcome.)
- ``leftovers``: a launcher parking 2 ranks, or an emulator's creator, is killed with SIGKILL;
  after a bounded wait, rank processes alive, processes left stopped, emulation watchdogs, cgroups
  and network namespaces still there are counted. A part whose kernel feature is missing is
  ``skipped`` with the reason.
- ``faults`` (kvpool): ``kvpool.faults.safety_counts``: wrong bytes and lost acknowledged writes in
  same-key PUT/GET races over ``kvpool serve`` (memory and SSD) and across kill -9 loops.

``bad_counts(report)`` lists every non-zero bad count; tests-integration/test_safety.py asserts it
is empty, and ``nox -s bench`` merges each package's counts into its bench JSON under ``safety``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib
import importlib.metadata
import io
import json
import logging
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from hwtopo import atomic_write_text
from hwtopo.testing import Payload

PACKAGES = ("hwtopo", "xronos", "geomesh", "cona", "bicache", "kvpool", "parser-moe", "sysprdict", "agentdyn")
# the counts that must be zero, per part; everything else in a part describes what was tried
BAD = {
    "cli": ("tracebacks", "bad_exit", "slow", "created", "code_executed"),
    "loaders": ("code_executed",),
    "leftovers": ("ranks_alive", "stopped", "watchdogs", "cgroups", "namespaces"),
    "faults": ("wrong_bytes", "lost_acked_writes", "dropped_chunks", "leaked_bytes"),
}
ALARM_S = 20  # per command line: every one must fail at argument checking, long before this
DEADLINE_S = 30.0  # what is left after a kill -9 must be gone within this
NOWHERE = "/proc/none"  # a directory nobody can create, root included


# ------------------------------------------------------------------------------- payloads ---


def write_payload(path: Path, marker: Path, torch_format: bool = True) -> Path:
    """A crafted file at ``path``: a torch zip checkpoint (or a plain pickle) holding a Payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if torch_format:
        import torch

        torch.save({"model": {"weight": Payload(marker)}, "step": 1}, path)
    else:
        path.write_bytes(pickle.dumps({"kind": "rf", "models": Payload(marker)}))
    return path


def payload_is_live(tmp: Path) -> bool:
    """The detector works: a plain unpickle of the crafted bytes does create the marker."""
    marker = tmp / "live-marker"
    pickle.loads(pickle.dumps(Payload(marker)))
    live = marker.exists()
    marker.unlink(missing_ok=True)
    return live


# ---------------------------------------------------------------------------- CLI corpus ---


def _spec(**machine) -> str:
    m = {"name": "a", "cores": 4, "memory": "8GiB", **machine}
    return json.dumps({"machines": [m, {"name": "b", "cores": 2}]})


def make_files(tmp: Path) -> dict[str, str]:
    """The files the corpus names, as ``<key>`` placeholders."""
    files = {
        "bin": ("binary.json", bytes(range(256)) * 16),
        "latin": ("latin1.toml", b'name = "caf\xe9"\n[[machines]]\nname = "\xff\xfe"\n'),
        "empty": ("empty.json", b""),
        "text": ("notes.txt", b"not a directory\n"),
        "cores": ("cores-1e26.json", _spec(cores=1e26).encode()),
        "meminf": ("memory-inf.json", _spec(memory="1e400GiB").encode()),
        "speedinf": ("speed-inf.json", _spec(speed=float("inf")).encode()),
        "threads": ("threads-below-cores.json", _spec(cores=4, threads=2).encode()),
        "mem0": ("memory-0.json", _spec(memory="0 B").encode()),
        "numa99": ("numa-cpu-99.json", _spec(numa_nodes=[{"id": 0, "cpus": "0-3,99"}]).encode()),
        "ckpt": ("ckpt/task.json", bytes(range(256))),  # a checkpoint dir whose task.json is binary
        "model": ("model/config.json", b"\x80\x04\x95garbage\xff"),  # a model dir, config.json not JSON
    }
    paths = {}
    for key, (name, data) in files.items():
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        paths[key] = str(p)
    paths["ckpt"], paths["model"] = str(tmp / "ckpt"), str(tmp / "model")
    paths["pickle"] = str(write_payload(tmp / "payload.pt", tmp / "cli-marker"))
    paths["pickle_json"] = str(write_payload(tmp / "payload.json", tmp / "cli-marker", torch_format=False))
    (tmp / "adir").mkdir()
    paths.update(
        dir=str(tmp / "adir"),
        missing=str(tmp / "missing.json"),
        nowhere=f"{NOWHERE}/x.json",
        nowhere_dir=f"{NOWHERE}/out",
        absent=str(tmp / "absent" / "deep" / "out"),  # parents missing: must stay missing
        fresh=str(tmp / "fresh"),  # a new leaf in an existing directory: may be created
        deep_json="[" * 100_000,
    )
    return paths


# one line per command line, shell-quoted; <key> is a path from make_files
CORPUS = {
    "hwtopo": """
        frobnicate
        --quiet
        check <missing>
        check <bin>
        check <latin>
        check <empty>
        check <cores>
        check <meminf>
        check <speedinf>
        check <threads>
        check <mem0>
        check <numa99>
        show <pickle>
        check <pickle_json>
        show <dir>
        check no-such-bundled-spec
        measure --quick --json <nowhere>
        measure --quick --disk <missing>
    """,
    "xronos": """
        train --speeds nan --ckpt-dir <nowhere_dir>
        train --speeds 1.0,inf --ckpt-dir <nowhere_dir>
        train --speeds 1.0,-1
        train --steps -1 --ckpt-dir <nowhere_dir>
        train --lr 1e30 --ckpt-dir <nowhere_dir>
        train --hidden 1e30 --ckpt-dir <nowhere_dir>
        train --data <missing> --ckpt-dir <nowhere_dir>
        train --ckpt-dir <nowhere_dir>
        train --ckpt-dir <absent>
        train --save <nowhere_dir>
        train --memory 1e400GiB --ckpt-dir <nowhere_dir>
        train --ckpt-dir <text>
        partition --cluster <bin>
        partition --cluster <pickle_json>
        partition --cluster <missing>
        partition --memory 1e400GiB,1GiB
        partition --speeds 1.0,0.5 --memory 1GiB
        bench --quick --json <nowhere>
        demo --out <nowhere_dir>
        demo --out <absent>
    """,
    "geomesh": """
        plan --target-tokens 1e30
        plan --target-tokens 1000000000000000000000000000000
        plan --tokens-per-s nan
        plan --tokens-per-s inf
        plan --seq-len -1
        plan --batch 0
        plan --fixed-memory 1e400GiB
        plan --memory-per-sample=-5MiB
        plan --cluster <bin>
        plan --cluster <latin>
        plan --cluster <missing>
        plan --cluster <pickle_json>
        bench --quick --json <nowhere>
        bench --wan tbf --json <nowhere>
        bench --outer-steps 1e30 --json <nowhere>
        demo --out <nowhere_dir>
        demo --out <absent>
    """,
    "cona": """
        no-such-command
        strategies --spec <bin>
        strategies --spec <missing>
        strategies --spec <pickle_json>
        strategies --hidden -1
        strategies --global-batches nan
        strategies --seq-len 0
        simulate --mfu nan
        simulate --mfu inf
        simulate --noise-scale -1
        simulate --model gpt-5
        simulate --top 0
        simulate --spec <latin>
        bench --quick --world 0 --json <nowhere>
        bench --quick --json <nowhere>
        demo --budget-s inf --out <nowhere_dir>
        demo --set bogus=1 --out <nowhere_dir>
        demo --out <absent>
    """,
    "bicache": """
        serve --port 0
        serve --port 70000
        serve --max-batch 1e30
        serve --bound nan
        serve --bound inf
        serve --host 192.0.2.1
        serve --checkpoint <missing>
        serve --checkpoint <bin>
        serve --checkpoint <ckpt> --port 8999
        calibrate --json <nowhere>
        calibrate --bound -1
        calibrate --checkpoint <ckpt>
        bench --quick --json <nowhere>
        demo --out <nowhere_dir>
        demo --out <absent>
        train --checkpoint <missing>
    """,
    "kvpool": """
        frobnicate
        serve --port -1
        serve --port 65536
        serve --memory-modules -1
        serve --memory-bytes 1e400GiB
        serve --ssd-bytes 0
        serve --layout bogus
        serve --ssd <nowhere_dir>
        serve --ssd <text>
        serve --memory-modules 0
        serve --host 192.0.2.1 --port 0
        bench --quick --json <nowhere>
        bench --quick --ssd-cap nan --json <nowhere>
        bench --quick --tokens 1e30
        bench --quick --io-backend mmap
        demo --workdir <absent> --out <fresh>
        demo --ssds 0 --out <nowhere_dir>
    """,
    "parser-moe": """
        compress
        compress --out <nowhere_dir>
        compress --keep nan --out <nowhere_dir>
        compress --keep 1.5 --out <nowhere_dir>
        compress --keep 0 --out <nowhere_dir>
        compress --model <missing> --out <nowhere_dir>
        compress --model <model> --out <fresh>
        compress --seed -1 --out <nowhere_dir>
        compress --threads 0 --out <nowhere_dir>
        compress --method bogus --out <nowhere_dir>
        compress --out <absent>
        bench --quick --json <nowhere>
        bench --ratios nan --json <nowhere>
        demo --out <nowhere_dir>
        train --out <nowhere_dir>
        train --steps 1e30 --out <nowhere_dir>
        train --seeds , --out <nowhere_dir>
    """,
    "sysprdict": """
        predict llama-s --batch 1e12
        predict llama-s --batch 1000000000000
        predict nope-s
        predict llama-s --seq-len -1
        predict llama-s --dataset <missing>
        predict llama-xs --dataset <bin>
        predict llama-xs --dataset <pickle>
        predict llama-s --bandwidth nan
        predict llama-s --zero-stage 4
        fit llama-s --memory 1e400GiB
        fit llama-s --memory 0
        fit llama-s --memory 1GiB --margin inf
        profile --out <nowhere>
        blockchain-bench --json <nowhere>
        blockchain-bench --data <missing>
        blockchain-bench --data <latin> --quick
        bench --quick --json <nowhere>
        demo --out <nowhere_dir>
        blockchain-demo --seed -1
    """,
    "agentdyn": """
        serve --port -1
        serve --host 192.0.2.1
        serve --drain-timeout nan
        serve --llm-timeout inf
        serve --profiles <nowhere>
        serve --profiles <dir>
        run rag_qa --input '{not json'
        run rag_qa --input <deep_json>
        run bogus_task
        run rag_qa --input '[1, 2]'
        run coding --tool-timeout -1
        llm-emulator --ttft nan
        llm-emulator --tokens-per-s 0
        llm-emulator --host 192.0.2.1
        bench --quick --json <nowhere>
        characterize --concurrency 0
        characterize --out <nowhere_dir>
        demo --out <nowhere_dir>
        demo --out <absent>
    """,
}


def corpus(package: str, paths: dict[str, str]) -> list[list[str]]:
    """``package``'s malformed command lines with the placeholders filled in."""
    fill = lambda tok: re.sub(r"<(\w+)>", lambda m: paths[m.group(1)], tok)  # noqa: E731
    return [[fill(t) for t in shlex.split(line)] for line in CORPUS[package].strip().splitlines()]


class Slow(BaseException):
    """Raised by the alarm: a BaseException so that no ``except Exception`` in a CLI swallows it."""


def _alarm(signum, frame):
    raise Slow


@contextlib.contextmanager
def _captured() -> Iterator[io.StringIO]:
    """stderr and stdout of Python code and of anything writing to fd 2 (children, C code), and a
    fresh root logger (a CLI's basicConfig binds its handler to the stream of its own call)."""
    text = io.StringIO()
    saved_fd, root = os.dup(2), logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    with tempfile.TemporaryFile() as raw:
        os.dup2(raw.fileno(), 2)
        try:
            with contextlib.redirect_stderr(text), contextlib.redirect_stdout(io.StringIO()):
                yield text
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            root.handlers[:], root.level = handlers, level
            raw.seek(0)
            text.write(raw.read().decode(errors="replace"))


def call_main(main: Callable[[list[str]], int | None], argv: list[str], alarm_s: int = ALARM_S) -> dict:
    """``main(argv)`` under an alarm: its exit code (None when it raised or was cut off), stderr, slow."""
    code, slow = None, False
    previous = signal.signal(signal.SIGALRM, _alarm)
    with _captured() as err:
        signal.alarm(alarm_s)
        try:
            code = int(main(argv) or 0)
        except SystemExit as e:  # argparse, or a handler's sys.exit
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Slow:
            slow = True
        except BaseException:  # noqa: BLE001 - an escaped exception is what is being counted
            traceback.print_exc(file=err)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
    return {"code": code, "stderr": err.getvalue(), "slow": slow}


def console_main(package: str) -> Callable[[list[str]], int | None]:
    """The function behind ``package``'s console script."""
    (ep,) = importlib.metadata.entry_points(group="console_scripts", name=package)
    return ep.load()


def cli_counts(package: str, tmp: Path, alarm_s: int = ALARM_S, main: Callable | None = None) -> dict:
    """Run ``package``'s corpus; the counts, with each bad outcome's command line in ``failures``."""
    main = main or console_main(package)
    work = tmp / f"cli-{package}"
    work.mkdir()
    paths = make_files(work)
    counts = dict.fromkeys(("inputs", *BAD["cli"]), 0)
    failures = []
    for argv in corpus(package, paths):
        r = call_main(main, argv, alarm_s)
        bad = {
            "tracebacks": "Traceback (most recent call last)" in r["stderr"],
            "bad_exit": not r["slow"] and r["code"] not in (1, 2),
            "slow": r["slow"],
            "created": (work / "absent").exists(),
            "code_executed": (work / "cli-marker").exists(),
        }
        shutil.rmtree(work / "absent", ignore_errors=True)
        (work / "cli-marker").unlink(missing_ok=True)
        counts["inputs"] += 1
        for k, v in bad.items():
            counts[k] += int(v)
        if any(bad.values()):
            last = r["stderr"].strip().splitlines()[-1:] or [""]
            failures.append(
                {"argv": argv[:8], "exit": r["code"], **{k: v for k, v in bad.items() if v}, "stderr": last[0][:300]}
            )
    return {**counts, "failures": failures}


# ------------------------------------------------------------------------------- loaders ---


# a one-layer transformers config: the loaders must get as far as the weights file
TINY_CONFIG = dict(
    vocab_size=32,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def _tiny_llama_dir(path: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(**TINY_CONFIG).save_pretrained(str(path))
    return path


def _load_xronos(d: Path, marker: Path) -> None:
    from xronos.train import read_checkpoint

    read_checkpoint(write_payload(d / "step-00000010" / "rank0.pt", marker))


def _load_geomesh(d: Path, marker: Path) -> None:
    import torch

    from geomesh import DiLoCo

    model = torch.nn.Linear(4, 4)
    dl = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 2, compression="sign", chunk_size=16)
    dl.load(write_payload(d / "rank0.pt", marker))


def _load_bicache_state(d: Path, marker: Path) -> None:
    from bicache.train import load_train_state

    load_train_state(write_payload(d / "train-state.pt", marker))


def _load_bicache_model(d: Path, marker: Path) -> None:
    """A checkpoint directory as ``--checkpoint`` takes it: task.json, config.json, pickled weights."""
    from dataclasses import asdict

    from transformers import Gemma3TextConfig

    from bicache.model import DiffusionLM
    from bicache.task import TaskSpec

    Gemma3TextConfig(**TINY_CONFIG, head_dim=4).save_pretrained(str(d))
    (d / "task.json").write_text(json.dumps(asdict(TaskSpec())))
    write_payload(d / "pytorch_model.bin", marker)
    DiffusionLM.load(d)


def _load_cona_state(d: Path, marker: Path) -> None:
    from cona.executor import load_state

    load_state(write_payload(d / "phase.safetensors", marker))


def _load_cona_probes(d: Path, marker: Path) -> None:
    from cona.probe import ProbeCache

    ProbeCache.open("key", write_payload(d / "probes.json", marker, torch_format=False))


def _load_parser_compressed(d: Path, marker: Path) -> None:
    from parser_moe.compressed import load_compressed

    _tiny_llama_dir(d)
    write_payload(d / "model.safetensors", marker)
    load_compressed(d)


def _load_parser_model(d: Path, marker: Path) -> None:
    """``--model DIR``: a transformers checkpoint whose weights are a pickle."""
    from parser_moe.bench import load_model

    write_payload(_tiny_llama_dir(d) / "pytorch_model.bin", marker)
    load_model(d, progress=False)


def _load_sysprdict_pickle(d: Path, marker: Path) -> None:
    from sysprdict.blockchain import PerfModel

    PerfModel.load(write_payload(d / "blockchain-rf.pkl", marker, torch_format=False))


def _load_sysprdict_npz(d: Path, marker: Path) -> None:
    """A model archive with an object array: np.load would unpickle it if allowed."""
    import numpy as np

    from sysprdict.blockchain import PerfModel

    with open(d / "model.npz", "wb") as f:
        np.savez(f, meta=np.array(json.dumps({"format": "x"})), value=np.array([Payload(marker)], dtype=object))
    PerfModel.load(d / "model.npz")


def _load_sysprdict_rows(d: Path, marker: Path) -> None:
    from sysprdict.dataset import load_rows

    load_rows(write_payload(d / "profile.jsonl", marker, torch_format=False))


def _load_sysprdict_caliper(d: Path, marker: Path) -> None:
    from sysprdict.blockchain.caliper import load_caliper

    load_caliper(write_payload(d / "report.json", marker, torch_format=False))


def _load_hwtopo(d: Path, marker: Path) -> None:
    import hwtopo

    hwtopo.load(str(write_payload(d / "spec.json", marker, torch_format=False)))


def _load_kvpool_tiers(d: Path, marker: Path) -> None:
    """The serialized-tiers baseline reads a chunk file planted under its disk directory."""
    from kvpool.baselines import SerialTiers
    from kvpool.keys import KVLayout, chunk_keys

    layout = KVLayout(1, 1, 4, chunk_tokens=4)
    tiers = SerialTiers(layout, "model", 0, d)
    tokens = [1, 2, 3, 4]
    write_payload(tiers._file(chunk_keys(tokens, "model", layout)[0].hex), marker)
    tiers.retrieve(tokens)


def _load_agentdyn(d: Path, marker: Path) -> None:
    from agentdyn.profiles import ProfileStore

    ProfileStore.load(write_payload(d / "profiles.json", marker, torch_format=False))


LOADERS: dict[str, dict[str, Callable[[Path, Path], None]]] = {
    "hwtopo": {"hwtopo.load": _load_hwtopo},
    "xronos": {"xronos.train.read_checkpoint": _load_xronos},
    "geomesh": {"geomesh.DiLoCo.load": _load_geomesh},
    "cona": {"cona.executor.load_state": _load_cona_state, "cona.probe.ProbeCache.open": _load_cona_probes},
    "bicache": {
        "bicache.train.load_train_state": _load_bicache_state,
        "bicache.model.DiffusionLM.load": _load_bicache_model,
    },
    "kvpool": {"kvpool.baselines.SerialTiers.retrieve": _load_kvpool_tiers},
    "parser-moe": {
        "parser_moe.compressed.load_compressed": _load_parser_compressed,
        "parser_moe.bench.load_model": _load_parser_model,
    },
    "sysprdict": {
        "sysprdict.blockchain.PerfModel.load (pickle)": _load_sysprdict_pickle,
        "sysprdict.blockchain.PerfModel.load (npz)": _load_sysprdict_npz,
        "sysprdict.dataset.load_rows": _load_sysprdict_rows,
        "sysprdict.blockchain.caliper.load_caliper": _load_sysprdict_caliper,
    },
    "agentdyn": {"agentdyn.profiles.ProfileStore.load": _load_agentdyn},
}


def loader_counts(package: str, tmp: Path) -> dict:
    """Feed each of ``package``'s loaders its crafted file; how each answered and whether code ran."""
    outcomes, executed = {}, 0
    for i, (name, load) in enumerate(LOADERS[package].items()):
        d, marker = tmp / f"load-{package}-{i}", tmp / f"marker-{package}-{i}"
        d.mkdir()
        try:
            with _captured():
                load(d, marker)
            outcomes[name] = "loaded"
        except Exception as e:  # noqa: BLE001 - refusing the file is the expected answer
            outcomes[name] = f"refused: {type(e).__name__}"
        executed += marker.exists()
    return {"payloads": len(outcomes), "code_executed": executed, "outcomes": outcomes}


# ----------------------------------------------------------------------------- leftovers ---


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def _wait(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _cmdlines() -> Iterator[tuple[int, list[str]]]:
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                yield int(d), Path(f"/proc/{d}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue


def _watchdogs(target: int) -> set[int]:
    """Emulation watchdogs (and their guardians) of ``target`` still running."""
    from hwtopo.emulate import WATCHDOG_MARKER

    out = set()
    for pid, args in _cmdlines():
        if WATCHDOG_MARKER in args:
            i = args.index(WATCHDOG_MARKER)
            if args[i + 1 : i + 2] == [str(target)] and _alive(pid):
                out.add(pid)
    return out


def _cgroups(creators: set[int]) -> set[str]:
    """hwtopo's cgroups made by any of ``creators`` (named ``hwtopo-<creator pid>-...``)."""
    from hwtopo import cgroups

    return {str(p) for h in cgroups._hierarchies() for c in creators for p in h.root.glob(f"{cgroups.PREFIX}{c}-*")}


def _net_namespaces() -> set[str]:
    """Every network namespace a process is in or holds a descriptor to."""
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            for link in (proc / "ns" / "net", *proc.glob("fd/*")):
                with contextlib.suppress(OSError):
                    if (t := os.readlink(link)).startswith("net:["):
                        found.add(t)
    return found


def _kill(*pids: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


PARK = """
import json, os, sys, time
{imports}

def park(rank, world, out):
    info = {{"pid": os.getpid(), "netns": os.readlink("/proc/self/ns/net")}}
    with open(os.path.join(out, f"rank{{rank}}.tmp"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(out, f"rank{{rank}}.tmp"), os.path.join(out, f"rank{{rank}}"))
    time.sleep(600)

if __name__ == "__main__":
    out = sys.argv[1]
    {call}
"""

LAUNCHERS = {
    "hwtopo": ("from hwtopo.launch import spawn", "spawn(park, 2, (out,), init_group=False, timeout_s=600)"),
    "xronos": (
        "import hwtopo\nfrom xronos.launch import spawn",
        "spawn(park, 2, (out,), speeds=(1.0, 0.5), timeout_s=600, "
        "emulate='cgroup' if hwtopo.cgroup_available() else 'dilate')",
    ),
    "cona": ("from cona.dist import launch", "launch(park, 2, out, timeout_s=600)"),
    "geomesh": (
        "import hwtopo\nfrom geomesh import NetnsWan, spawn",
        "c = hwtopo.load('geo-3region')\n    net = NetnsWan(c, c.names[:2]).setup()\n"
        "    spawn(park, 2, (out,), setup=net.enter, start_method='fork', timeout_s=600, pg_timeout_s=600)",
    ),
}


def launcher_leftovers(package: str, tmp: Path) -> dict:
    """Start ``package``'s launcher with 2 parked ranks, SIGKILL it, count what is left."""
    if package == "geomesh":
        from geomesh.netns import netns_support

        ok, why = netns_support()
        if not ok:
            return {"skipped": f"network namespaces unavailable: {why}"}
    out = tmp / f"launch-{package}"
    out.mkdir()
    imports, call = LAUNCHERS[package]
    script = out / "launcher.py"
    script.write_text(textwrap.dedent(PARK).format(imports=imports, call=call))
    launcher = subprocess.Popen(
        [sys.executable, str(script), str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    ranks: list[dict] = []
    try:
        started = _wait(lambda: all((out / f"rank{r}").exists() for r in range(2)) or launcher.poll() is not None, 120)
        if not started or launcher.poll() is not None:
            err = launcher.stderr.read().decode(errors="replace")[-400:] if launcher.poll() is not None else ""
            return {"error": f"the ranks did not start ({err.strip() or 'timeout'})"}
        time.sleep(0.5)  # both ranks past their setup (a throttle, a namespace) and parked
        ranks = [json.loads((out / f"rank{r}").read_text()) for r in range(2)]
        held = {t for f in Path(f"/proc/{launcher.pid}/fd").glob("*") if (t := _readlink(f)).startswith("net:[")}
        made = len(_cgroups({r["pid"] for r in ranks} | {launcher.pid}))
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stderr.close()
    pids = {r["pid"] for r in ranks}
    _wait(lambda: not any(_alive(p) for p in pids) and not _cgroups(pids | {launcher.pid}), DEADLINE_S)
    left = {
        "ranks": len(pids),
        "cgroups_made": made,
        "namespaces_held": len(held),
        "ranks_alive": sum(_alive(p) for p in pids),
        "stopped": sum(_state(p) == "T" for p in pids),
        "watchdogs": sum(len(_watchdogs(p)) for p in pids),
        "cgroups": len(_cgroups(pids | {launcher.pid})),
        "namespaces": len(held & _net_namespaces()),
    }
    _kill(*pids)
    return left


def _readlink(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


SLEEPER = "import time; time.sleep(120)"
# speed 0.001 of a 1 s period: 1 ms running, 999 ms stopped, so the kill lands in the stop phase
CREATORS = {
    "throttle": (
        f"p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}])\n"
        "t = hwtopo.throttle(p.pid, 0.001, method='duty-cycle', period_s=1.0)\n"
    ),
    "cgroup": (
        f"p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}])\n"
        "g = hwtopo.CGroup('safety', account=True)\n"
        "g.add(p.pid)\n"
        "t = hwtopo.throttle(None, 0.5, method='cgroup')\n"
    ),
}


def emulator_leftovers(kind: str) -> dict:
    """An emulator's creator (a throttled child, or cgroups) is SIGKILLed; count what is left."""
    import hwtopo

    if kind == "cgroup" and not hwtopo.cgroup_available():
        return {"skipped": "no writable cgroup cpu controller here"}
    code = f"import os, subprocess, sys, time, hwtopo\n{CREATORS[kind]}print(p.pid, flush=True)\ntime.sleep(120)\n"
    creator = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = creator.stdout.readline().split()
    target = int(line[0]) if line else None
    try:
        if target is None:
            return {"error": "the creator printed no target pid"}
        # kill while the target is stopped (throttle); after the creator made its groups (cgroup)
        stopped_at_kill = kind == "throttle" and _wait(lambda: _state(target) == "T", DEADLINE_S)
        made = len(_cgroups({creator.pid}))
    finally:
        creator.kill()
        creator.wait()
        creator.stdout.close()
    _wait(lambda: _state(target) != "T" and not _watchdogs(target) and not _cgroups({creator.pid}), DEADLINE_S)
    left = {
        "cgroups_made": made,
        "stopped_at_kill": stopped_at_kill,
        "stopped": int(_state(target) == "T"),
        "watchdogs": len(_watchdogs(target)),
        "cgroups": len(_cgroups({creator.pid})),
    }
    _kill(target)
    return left


def leftover_counts(package: str, tmp: Path) -> dict:
    """Every kill -9 scenario of ``package``, each with its counts (or why it was skipped)."""
    runs = {}
    if package in LAUNCHERS:
        runs["launcher"] = launcher_leftovers(package, tmp)
    if package == "hwtopo":
        runs["throttle_creator"] = emulator_leftovers("throttle")
        runs["cgroup_creator"] = emulator_leftovers("cgroup")
    totals = {k: sum(r.get(k, 0) for r in runs.values()) for k in BAD["leftovers"]}
    totals["errors"] = [f"{name}: {r['error']}" for name, r in runs.items() if "error" in r]
    return {**totals, "runs": runs, "skipped": {n: r["skipped"] for n, r in runs.items() if "skipped" in r}}


# --------------------------------------------------------------------------------- kvpool ---


def kvpool_faults(pairs: int = 2000, kills: int = 20) -> dict:
    """The issue's sizes by default: 2,000 same-key PUT/GET pairs per device kind, 20 kill -9 loops."""
    from kvpool.faults import safety_counts

    t0 = time.perf_counter()
    res = safety_counts(pairs=pairs, kills=kills)
    return {**res, "sizes": {"pairs": pairs, "kills": kills}, "wall_s": round(time.perf_counter() - t0, 1)}


# --------------------------------------------------------------------------------- report ---


def _installed(package: str) -> bool:
    return bool(importlib.metadata.entry_points(group="console_scripts", name=package))


def measure(packages=PACKAGES, pairs: int = 2000, kills: int = 20, alarm_s: int = ALARM_S) -> dict:
    """Every part for every package in ``packages`` (a package not installed here is left out)."""
    import hwtopo

    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="mlsyskit-safety-") as tmp:
        live = payload_is_live(Path(tmp))
        for pkg in packages:
            if not _installed(pkg):
                report[pkg] = {"skipped": "not installed in this environment"}
                continue
            entry = {"cli": cli_counts(pkg, Path(tmp), alarm_s), "loaders": loader_counts(pkg, Path(tmp))}
            entry["loaders"]["payload_live"] = live
            if pkg in LAUNCHERS or pkg == "hwtopo":
                entry["leftovers"] = leftover_counts(pkg, Path(tmp))
            if pkg == "kvpool":
                entry["faults"] = kvpool_faults(pairs, kills)
            report[pkg] = entry
    report["measured_at"] = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    report["machine"] = hwtopo.probe().name
    return report


def bad_counts(report: dict) -> list[str]:
    """``package.part.count = n`` for every bad count that is not zero, and every part that failed to run."""
    out = []
    for pkg, entry in report.items():
        if not isinstance(entry, dict):
            continue
        for part, keys in BAD.items():
            res = entry.get(part)
            if res is None:
                continue
            out += [f"{pkg}.{part}.{k} = {res[k]}" for k in keys if res.get(k)]
            out += [f"{pkg}.{part}: {e}" for e in res.get("errors", [])]
        if entry.get("loaders") and not entry["loaders"].get("payload_live", True):
            out.append(f"{pkg}.loaders: the crafted payload did not run under a plain unpickle")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write the counts here")
    ap.add_argument("--only", help=f"comma-separated packages (default: all of {', '.join(PACKAGES)})")
    ap.add_argument("--pairs", type=int, default=2000, help="kvpool same-key PUT/GET pairs per device kind")
    ap.add_argument("--kills", type=int, default=20, help="kvpool kill -9 loops during puts")
    a = ap.parse_args(argv)
    wanted = [p.strip() for p in a.only.split(",") if p.strip()] if a.only else list(PACKAGES)
    unknown = [p for p in wanted if p not in PACKAGES]
    if unknown:
        ap.error(f"--only: {', '.join(unknown)} not among {', '.join(PACKAGES)}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    report = measure(wanted, a.pairs, a.kills)
    if a.json:
        atomic_write_text(a.json, json.dumps(report, indent=2) + "\n")
    bad = bad_counts(report)
    for line in bad:
        print(f"safety: {line}", file=sys.stderr)
    print(f"safety: {len(bad)} bad count(s) over {', '.join(wanted)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
