"""The demos: small tasks that learn on a 2-core CPU, one folder each, to read and to copy.

A demo's folder holds everything that makes it:

    demos/NAME/
      __init__.py   what it provides, as plain constants: PRESET, SOURCES, MODEL
      task.py       the task: rows generated in code (train and held-out splits), or an environment
      build.py      the program that builds its warm start (or reward model) from scratch, offline
      weights/      what build.py made, shipped with the package (a few MB)
      preset.toml   the run: ``nanogrpo train --config demo-NAME``

``arithmetic`` is the default demo (preset ``demo``, model ``embedded``); every other folder's
preset is ``demo-NAME`` and its weights load as model ``embedded-NAME`` (``rm`` ships a reward
model: ``rm:embedded-rm``).

The demos sit over the library, as a user's own package would: nothing in nanogrpo's layers imports
them. Each registers itself in nanogrpo's ``pyproject.toml`` (entry points ``nanogrpo.demos``), and the
data sources, models and presets are found there by name (:mod:`nanogrpo.entry_points`). A package of
your own registers its tasks the same way: copy a folder into it, change its constants, and name it
in your ``pyproject.toml``::

    [project.entry-points."nanogrpo.demos"]
    mytask = "mypkg.mytask"

What the builders share (torch on one thread, supervised steps, an atomic save) is
:mod:`nanogrpo.demos.warm_start`. This module is documentation only: nothing runs on import. A task
module imports nothing above ``nanogrpo.errors``; a builder or environment may import anything.
"""
