"""Counts, the loop's first room: the count boot boots a real engine with the hook counting, replays a workload and
keeps the counts; the parity gate replays the same way and keeps a greedy reference.

- :mod:`~pinsidecar.counts.workload` — the JSONL workload format and the replay client;
- :mod:`~pinsidecar.counts.count_boot` — boot with the hook in count mode, replay, keep the counts;
- :mod:`~pinsidecar.counts.parity` — record greedy tokens and logprobs, and check them after a map change.
"""
