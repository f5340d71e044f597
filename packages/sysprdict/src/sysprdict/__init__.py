"""sysprdict: system performance prediction."""

__version__ = "0.1.0"
