"""The benchmarks, importable as a package for the tests that keep them from rotting (``from bench import
placement``; pytest puts the repository root on the path, ``pythonpath`` in ``pyproject.toml``).

Each is still run as a file, ``python bench/<name>.py`` (the commands in ``docs/`` and ``bench/results/``); one that
imports a sibling puts the repository root on the path when it runs as a file, so the sibling imports as
``bench.<sibling>`` either way. Not part of the installed distribution.
"""
