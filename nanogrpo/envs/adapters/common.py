"""What the adapters share: importing their library lazily, with a one-line error saying what to install."""

from __future__ import annotations

from nanogrpo.errors import ConfigError


def require(module: str, package: str, what: str):
    """``import module`` or a one-line :class:`ConfigError` saying which package to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{what} needs the {package!r} package: pip install {package} "
                          f"(or pip install 'nanogrpo[envs]') ({type(e).__name__}: {e})") from None
