"""The remap pipeline: the loop's last step, from "traffic moved" to a new row map serving, or the old one still.

A trigger (the drift watch in the daemon, an Alertmanager alert, ``pinsidecar remap``, the systemd timer) asks the
daemon for a remap; :class:`~pinsidecar.remap.pipeline.RemapPipeline` runs it as a state machine persisted on
disk. The rooms, one idea each:

- :mod:`~pinsidecar.remap.record` — the record and its states, written atomically at every transition;
- :mod:`~pinsidecar.remap.admission` — one remap at a time, every trigger through the same cooldown and cap;
- :mod:`~pinsidecar.remap.traffic` — what the candidate is built from: captured traffic, or the live windows;
- :mod:`~pinsidecar.remap.candidates` — the map library (checked first), the rebuilt candidate (the one map
  builder, :func:`~pinsidecar.placement.rebuild_map`, with the active map's geometry) and how it lands in the library;
- :mod:`~pinsidecar.remap.decision` — the evaluation: deploy a candidate only when it predicts fewer cold selections
  than the active map on a held-out window of the traffic served (never one that predicts worse);
- :mod:`~pinsidecar.remap.deploy` — the deploy contract (deploy, verify, roll back) and the shared verify-commit
  tail; :mod:`~pinsidecar.remap.in_place` and :mod:`~pinsidecar.remap.reboot` — its two deploys;
- :mod:`~pinsidecar.remap.apply` — the hook's apply request and its answer (the in-place deploy's client);
- :mod:`~pinsidecar.remap.parity` — parity across either deploy; :mod:`~pinsidecar.remap.verify` — the parity
  prompts and the live cold-rate probe;
- :mod:`~pinsidecar.remap.commit` — ``active-map.json``, the commit point, written durably before ``committed``;
- :mod:`~pinsidecar.remap.recovery` — closing the records a killed sidecar left open;
- :mod:`~pinsidecar.remap.dry_run` — the decision a remap would reach now, changing nothing;
- :mod:`~pinsidecar.remap.replay` — recorded windows through the drift watch and the decision, offline
  (``pinsidecar drift replay``);
- :mod:`~pinsidecar.remap.run`, :mod:`~pinsidecar.remap.host`, :mod:`~pinsidecar.remap.tools` — one remap's working
  state, what the pipeline asks of the daemon (it never imports it), and its blocking actions;
- :mod:`~pinsidecar.remap.pipeline` — the steps in order;
- :mod:`~pinsidecar.remap.config` — the ``[remap]`` table.

Why it is shaped this way:

- **Live mode exists** because pin mode's partition kernel counts the full per-layer expert histogram of every
  routed token online: a candidate can be built from served traffic with no count boot and no second engine,
  which is what a host with one GPU needs, and what systems that can only count offline cannot do.
- **The library is checked first** because traffic classes come back; a map already on disk costs a reboot, a
  count boot minutes of a second engine.
- **The count boot runs beside the serving engine** (its own port), so clients are served throughout; on the CPU
  lane and on multi-GPU hosts that is free, and a single-GPU host uses live mode instead.
- **A blend is never built**: a map built from mixed traffic was measured to cost the majority class 10 %
  against its own map, so a candidate is built from the traffic served now only, and each class keeps its map.
"""


__all__: list[str] = []  # nothing here is another package's business
