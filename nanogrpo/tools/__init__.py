"""Tools for multi-turn rollouts: call protocols, the sandbox, the built-in Python tool.

A tool is a plain function ``fn(call: str, sample: dict) -> str``, named ``module:function`` or
``path/to/file.py:function`` like a reward (``python`` is the built-in sandboxed interpreter,
:func:`nanogrpo.tools.python.run_python`). Importing this package has no side effects and pulls
in nothing heavy: the sandbox's fork server imports tool modules on its own.
"""
