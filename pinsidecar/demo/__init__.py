"""The demo: a tiny local MoE model with domain-skewed routing, its prompt fixtures, and the demo loop.

- :mod:`~pinsidecar.demo.model` — build the model (random weights shaped so that two traffic domains prefer
  distinct expert sets) and find the shipped fixtures;
- :mod:`~pinsidecar.demo.loop` — ``pinsidecar demo``: count boot, maps, evaluation, pin-mode replay.
"""
