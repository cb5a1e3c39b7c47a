"""Runs of a real engine that produce an artifact: the count boot (counts) and parity (a greedy reference).

- :mod:`~pinsidecar.runs.workload` — the JSONL workload format and the replay client;
- :mod:`~pinsidecar.runs.count_boot` — boot with the hook in count mode, replay, keep the counts;
- :mod:`~pinsidecar.runs.parity` — record greedy tokens and logprobs, and check them after a map change.
"""
