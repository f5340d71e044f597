"""The command-line convention every mlsyskit console script follows, in one place.

    parser, sub = console.parser("kvpool", "One KV pool across memory and SSDs.", __version__)
    bench = console.command(sub, "bench", "the headline comparison")
    bench.add_argument("--reps", type=console.positive_int("--reps"), default=5)
    def main(argv=None): return console.run(parser, {"bench": cmd_bench}, argv)

Exit codes: 0 done, 2 bad input (``UsageError`` or argparse), 1 a runtime failure (one line;
the traceback only with ``--debug``), 130 interrupted. ``--version`` on the program, ``--quiet`` and
``--debug`` both before and after the subcommand. Progress goes through tqdm (plain lines when
stderr is not a terminal), tables through tabulate, the cache directory through platformdirs;
output paths are checked before any work and only the directory the user named is ever created.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .probe import probe_cluster
from .spec import atomic_file, atomic_write_text, to_dict

__all__ = [
    "UsageError",
    "parser",
    "command",
    "run",
    "integer",
    "number",
    "positive_int",
    "positive_float",
    "fraction",
    "size",
    "output_file",
    "output_dir",
    "bench_doc",
    "write_json",
    "progress",
    "table",
    "cache_dir",
    "pyplot",
    "save_figure",
]

log = logging.getLogger(__name__)


class UsageError(ValueError):
    """Bad input from the user: the CLI prints the one sentence and exits 2."""


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress output")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="debug logs and tracebacks")
    return common


def parser(prog: str, description: str, version: str) -> tuple[argparse.ArgumentParser, Any]:
    """The program's parser (``--version``, ``--quiet``, ``--debug``) and its subcommand group."""
    p = argparse.ArgumentParser(prog=prog, description=description, parents=[_common()])
    p.add_argument("--version", action="version", version=f"{prog} {version}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    return p, sub


def command(sub: Any, name: str, help: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand that also takes ``--quiet``/``--debug`` after its name; defaults in ``--help``."""
    kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
    return sub.add_parser(name, help=help, description=help, parents=[_common()], **kwargs)


def _setup_logging(debug: bool, quiet: bool) -> None:
    level = logging.DEBUG if debug else (logging.ERROR if quiet else logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", force=True)


def run(
    p: argparse.ArgumentParser,
    handlers: Mapping[str, Callable[[argparse.Namespace], int | None]],
    argv: Sequence[str] | None = None,
) -> int:
    """Parse ``argv``, call the handler of the chosen subcommand, map failures to exit codes."""
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # --help, --version, or argparse's own usage error (2)
        return int(e.code or 0)
    args.quiet = getattr(args, "quiet", False)
    args.debug = getattr(args, "debug", False)
    _setup_logging(args.debug, args.quiet)
    try:
        return int(handlers[args.cmd](args) or 0)
    except UsageError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{p.prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place a failure becomes an exit code
        if args.debug:
            traceback.print_exc()
        # a bare KeyError or an empty message says nothing without its type
        text = f"{type(e).__name__}: {e}" if isinstance(e, LookupError) or not str(e) else str(e)
        print(f"{p.prog}: error: {text}", file=sys.stderr)
        return 1


def _bound(x: float, kind: type) -> str:
    return str(int(x)) if kind is int else f"{x:g}"


def _number(text: str, field: str, kind: type, low: float, high: float | None, closed: bool) -> float:
    try:
        v = kind(text)
        finite = kind is int or math.isfinite(v)  # an int of any size is finite (isfinite would overflow)
    except ValueError:
        v, finite = math.nan, False
    ok = finite and (v >= low if closed else v > low) and (high is None or v <= high)
    if not ok:
        what = "an integer" if kind is int else "a number"
        bound = f"{'>=' if closed else '>'} {_bound(low, kind)}" + (
            "" if high is None else f" and <= {_bound(high, kind)}"
        )
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise argparse.ArgumentTypeError(f"{field} must be {what} {bound}, not {shown!r}")
    return v


def integer(field: str, low: int, high: int) -> Callable[[str], int]:
    """argparse type: an integer in [``low``, ``high``] (a port, a seed, a count), the error naming ``field``."""
    return lambda text: int(_number(text, field, int, low, high, True))


def number(field: str, low: float, high: float | None = None, *, inclusive: bool = True) -> Callable[[str], float]:
    """argparse type: a finite number >= ``low`` (> with ``inclusive=False``) and <= ``high``."""
    return lambda text: _number(text, field, float, low, high, inclusive)


def positive_int(field: str, maximum: int | None = None) -> Callable[[str], int]:
    """argparse type: an integer >= 1 (and <= ``maximum``), the error naming ``field``."""
    return lambda text: int(_number(text, field, int, 1, maximum, True))


def positive_float(field: str, maximum: float | None = None) -> Callable[[str], float]:
    """argparse type: a finite number > 0 (and <= ``maximum``), the error naming ``field``."""
    return number(field, 0.0, maximum, inclusive=False)


def fraction(field: str) -> Callable[[str], float]:
    """argparse type: a number in [0, 1]."""
    return number(field, 0.0, 1.0)


def size(field: str, maximum: float = 2.0**50) -> Callable[[str], int]:
    """argparse type: a byte size such as ``256MiB`` or ``4GB``, >= 1 B and <= ``maximum`` (1 PiB)."""
    from .units import SpecError, format_bytes, parse_bytes

    def parse(text: str) -> int:
        try:
            v = parse_bytes(text, field)
        except (SpecError, ValueError, OverflowError):
            v = math.nan
        if not (math.isfinite(v) and 1 <= v <= maximum):
            shown = text if len(text) <= 40 else text[:37] + "..."
            raise argparse.ArgumentTypeError(
                f"{field} must be a size from 1 B to {format_bytes(maximum)}, e.g. 256MiB, not {shown!r}"
            )
        return int(v)

    return parse


def output_file(path: str | os.PathLike, field: str) -> Path:
    """``path`` if a file can be written there; else UsageError naming ``field``. Creates nothing."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{field} {str(p)!r} is a directory; give a file path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{field} {str(p)!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{field} {str(p)!r} is not writable")
    return p


DEMO_ROOT = Path("demo-output")  # the default root every demo writes under, created when missing


def output_dir(path: str | os.PathLike, field: str) -> Path:
    """Directory ``path``, created if its parent exists (never a chain of parents); else UsageError.

    The one exception is the shared default root ``demo-output/`` in the working directory, so that
    ``<pkg> demo`` with its default ``--out demo-output/<pkg>`` works in a fresh directory.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{field} {str(p)!r} exists and is not a directory")
    if not p.exists():
        parent = p.parent if str(p.parent) else Path(".")
        if parent == DEMO_ROOT:
            parent.mkdir(exist_ok=True)
        if not parent.is_dir():
            raise UsageError(f"{field} {str(p)!r}: its parent {str(parent)!r} does not exist; create it first")
        try:
            p.mkdir(exist_ok=True)  # another process (a torchrun peer) may create it at the same moment
        except OSError as e:
            raise UsageError(f"{field} {str(p)!r} cannot be created: {e.strerror}") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise UsageError(f"{field} {str(p)!r} is not writable")
    return p


def bench_doc(package: str, version: str, config: Any, results: Any, headline: Any, **extra: Any) -> dict:
    """The ``bench --json`` document: package, version, config, the machine as hwtopo probes it,
    results and headline, in that order, then the package's own keys (``extra``)."""
    doc = {"package": package, "version": version, "config": config, "machine": to_dict(probe_cluster())}
    return {**doc, "results": results, "headline": headline, **extra}


def write_json(path: str | os.PathLike, obj: Any, *, allow_nan: bool = True) -> None:
    """``obj`` as indented JSON at ``path``, written whole or not at all; values JSON has no type
    for (paths, dtypes) as their text. ``allow_nan=False`` refuses NaN and infinities."""
    atomic_write_text(path, json.dumps(obj, indent=2, default=str, allow_nan=allow_nan) + "\n")


class _Lines:
    """A file for tqdm that turns its carriage-return redraws into whole lines (logs, CI)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, s: str) -> None:
        s = s.replace("\r", "").strip()
        if s:
            self.stream.write(s + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", quiet: bool = False):
    """A tqdm bar on a terminal, a line every 15 s otherwise, nothing when ``quiet``."""
    from tqdm.auto import tqdm

    tty = sys.stderr.isatty()
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        disable=quiet,
        file=sys.stderr if tty else _Lines(sys.stderr),
        mininterval=0.1 if tty else 15.0,
        dynamic_ncols=tty,
        leave=True,
    )


def table(rows: Iterable[Sequence[Any]] | Iterable[Mapping[str, Any]], headers: Sequence[str] | str = "keys") -> str:
    """Rows as a Markdown (GitHub) table: readable in a terminal and pasted into a report as is."""
    from tabulate import tabulate

    return tabulate(list(rows), headers=headers, tablefmt="github", floatfmt="g", missingval="-")


def cache_dir(package: str, env_var: str | None = None) -> Path:
    """Where ``package`` caches models and probes: ``$env_var``, else ``$MLSYSKIT_CACHE_DIR/<package>``,
    else the user cache directory (``~/.cache/mlsyskit/<package>`` on Linux). Not created here."""
    if env_var and os.environ.get(env_var):
        return Path(os.environ[env_var])
    if os.environ.get("MLSYSKIT_CACHE_DIR"):
        return Path(os.environ["MLSYSKIT_CACHE_DIR"]) / package
    from platformdirs import user_cache_path

    return user_cache_path("mlsyskit", appauthor=False) / package


def pyplot(package: str):
    """matplotlib.pyplot on the Agg backend, or None (logged once) when the ``plot`` extra is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'mlsyskit-%s[plot]'); no plots written", package)
        return None
    return plt


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 100) -> Path:
    """Lay ``fig`` out tightly, write it to ``path`` whole or not at all (the format from the
    suffix, e.g. ``.png``), and close it so a long run does not keep every figure in memory."""
    import matplotlib.pyplot as plt

    p = Path(path)
    try:
        fig.tight_layout()
        with atomic_file(p, "wb") as fh:
            fig.savefig(fh, dpi=dpi, format=p.suffix.lstrip(".") or None)
    finally:
        plt.close(fig)
    return p
