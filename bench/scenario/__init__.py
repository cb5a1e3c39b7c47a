"""The scenario harness of the daemon benchmarks: a real ``pinsidecar run`` daemon on the CPU demo lane (or a GPU
engine), streaming clients through its gate, and what they saw while it remapped, rebooted or lost its engine.

Used by the benchmarks (``bench/heal_scenario.py``, ``bench/remap_in_place.py``, ``bench/apply_engine.py``) and by
the tests that keep them honest (``tests/test_heal_scenario.py``, ``tests/test_remap_in_place.py``,
``tests/test_soak.py``, ``tests/test_scenario_*.py``), and by nothing that ships: it lives beside the benchmarks,
not in :mod:`pinsidecar.testing` (which keeps the pytest plugin, the fakes and the artifact builders).

- :mod:`~bench.scenario.remap_lane` — the lane: the demo's maps of two traffic classes at two geometries, and a
  daemon that remaps (or drain-reboots) under streaming clients;
- :mod:`~bench.scenario.heal` — the "heal" scenario: a traffic shift, an automatic remap, a drain-reboot onto
  another geometry and a SIGKILLed engine, in stages;
- :mod:`~bench.scenario.sampler` — its per-second sampler; :mod:`~bench.scenario.figures` — the figures of what a
  run recorded; :mod:`~bench.scenario.plot` — the run as one picture (the ``plot`` extra);
- :mod:`~bench.scenario.jit_cache` — which Triton kernels an engine compiled, and when.
"""
