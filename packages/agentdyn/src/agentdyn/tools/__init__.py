"""The agent tools, each run inside the sandbox (``agentdyn.toolexec``): name -> fn(args, workdir) -> dict."""

from __future__ import annotations

from .coding import apply_patch, read_file, repo_init, run_tests
from .diag import burn, sleep, whereami
from .rag import rag_index, rag_query
from .websearch import web_search

TOOLS = {
    "rag_index": rag_index,
    "rag_query": rag_query,
    "web_search": web_search,
    "repo_init": repo_init,
    "read_file": read_file,
    "apply_patch": apply_patch,
    "run_tests": run_tests,
    "sleep": sleep,
    "burn": burn,
    "whereami": whereami,
}

__all__ = ["TOOLS"]
