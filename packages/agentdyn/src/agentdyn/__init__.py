"""agentdyn: resource dynamics of AI agents -- sandboxed tools, a resource monitor, CPU-aware tool
admission and task-aware CPU allocation, on an asyncio agent runtime with an OpenAI-compatible LLM.

Imports are lazy so that the sandboxed tool wrapper (``python -m agentdyn.toolexec``) starts fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "AdmissionPolicy": "admission",
    "CpuAdmission": "admission",
    "AllocationPlan": "allocation",
    "TaskAwareAllocator": "allocation",
    "plan_allocation": "allocation",
    "split_threshold": "allocation",
    "EmulatorConfig": "emulator",
    "LLMEmulator": "emulator",
    "LLMClient": "llm",
    "LLMConfig": "llm",
    "LLMError": "llm",
    "SystemSampler": "monitor",
    "Usage": "monitor",
    "read_psi": "monitor",
    "ProfileStore": "profiles",
    "AgentRequest": "runtime",
    "AgentResult": "runtime",
    "Harness": "runtime",
    "Runtime": "runtime",
    "TASK_TYPES": "runtime",
    "Sandbox": "sandbox",
    "SandboxLimits": "sandbox",
    "CpuAwarePolicy": "scheduler",
    "NativePolicy": "scheduler",
    "StaticLimitPolicy": "scheduler",
    "make_policy": "scheduler",
    "FixtureSite": "website",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'agentdyn' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
