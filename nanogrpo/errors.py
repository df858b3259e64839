"""User-facing errors. Each one carries a single line saying what is wrong and where.

The CLI prints ``str(error)`` and exits non-zero; nothing else is printed for these,
so the message must stand on its own.
"""


class NanoGRPOError(Exception):
    """Base class for errors the user can fix (bad input, bad config, missing files)."""


class ConfigError(NanoGRPOError):
    """A config file, override or value is malformed or unknown."""


class DataError(NanoGRPOError):
    """A dataset cannot be found, read, or lacks the named fields."""


class ModelError(NanoGRPOError):
    """A model or tokenizer cannot be loaded."""


class RewardError(NanoGRPOError):
    """A reward function cannot be resolved or imported."""


class ToolError(NanoGRPOError):
    """A tool cannot be resolved or its sandbox cannot start."""


class InstallError(NanoGRPOError):
    """nanogrpo's install is incomplete or a package registered with it is broken (its package metadata:
    the demos' registry, :mod:`nanogrpo.entry_points`)."""
