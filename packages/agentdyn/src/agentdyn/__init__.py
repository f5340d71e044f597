"""agentdyn: resource dynamics of AI agents -- sandboxed tools, a resource monitor, CPU-aware tool
admission and task-aware CPU allocation, on an asyncio agent runtime with an OpenAI-compatible LLM.

Imports are lazy so that the sandboxed tool wrapper (``python -m agentdyn.toolexec``) starts fast.
"""

from __future__ import annotations

import lazy_loader

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "admission": ["AdmissionPolicy", "CpuAdmission"],
        "allocation": ["AllocationPlan", "TaskAwareAllocator", "plan_allocation", "split_threshold"],
        "emulator": ["EmulatorConfig", "LLMEmulator"],
        "llm": ["LLMClient", "LLMConfig", "LLMError"],
        "monitor": ["SystemSampler", "Usage", "read_psi"],
        "profiles": ["ProfileStore"],
        "runtime": ["AgentRequest", "AgentResult", "Harness", "Runtime", "TASK_TYPES"],
        "sandbox": ["Sandbox", "SandboxLimits", "SandboxUnavailable", "missing_layers"],
        "scheduler": ["CpuAwarePolicy", "FairPolicy", "NativePolicy", "StaticLimitPolicy", "make_policy"],
        "website": ["FixtureSite"],
    },
)
__all__ += ["__version__"]
