"""Every name the package exports resolves; the lazy ``__init__`` names nothing that is not there."""

import agentdyn


def test_every_exported_name_resolves():
    assert "__version__" in agentdyn.__all__ and "Runtime" in dir(agentdyn)
    missing = [n for n in agentdyn.__all__ if getattr(agentdyn, n, None) is None]
    assert missing == []
