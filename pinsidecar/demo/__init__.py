"""The demo: a tiny local MoE model with domain-skewed routing, its prompt fixtures, and the demo loop.

- :mod:`~pinsidecar.demo.model` — build the model (random weights shaped so that two traffic domains prefer
  distinct expert sets) and find the shipped fixtures;
- :mod:`~pinsidecar.demo.loop` — ``pinsidecar demo``: the whole loop, from a count boot to a committed remap, and
  its verdict;
- :mod:`~pinsidecar.demo.options` — what a run is given: its options and the display it reports through;
- :mod:`~pinsidecar.demo.stages` — the loop's stages, in order, as the methods of one run;
- :mod:`~pinsidecar.demo.report` — what the loop reports: a person's lines, the summary's figures;
- :mod:`~pinsidecar.demo.timeline` — where each stage of a run fell in time (the heal scenario's too);
- :mod:`~pinsidecar.demo.sidecar` — the demo's daemon: its config, ``pinsidecar run`` as a child, its clean stop;
- :mod:`~pinsidecar.demo.clients` — clients sending one traffic domain at a time through the gate.
"""
