"""The sidecar daemon: supervise one engine, front it with a drain gate, and take operators' commands.

- :mod:`~pinsidecar.daemon.config` — the TOML config, validated completely on load;
- :mod:`~pinsidecar.daemon.service` — the daemon itself: the wiring of its parts (start order, stop);
- :mod:`~pinsidecar.daemon.drain` — the one drain-reboot (the control API's and every remap's);
- :mod:`~pinsidecar.daemon.drift_loop` — the live stats on a timer into the drift watch; a trip asks for a remap;
- :mod:`~pinsidecar.daemon.remap_host` — the daemon as the remap pipeline's host;
- :mod:`~pinsidecar.daemon.status_view` — what ``GET /status`` answers, read from the parts when asked;
- :mod:`~pinsidecar.daemon.supervisor` — boot, readiness, restarts with backoff, the crash loop;
- :mod:`~pinsidecar.daemon.engine_state` — the engine's states and the transitions allowed between them, as data;
- :mod:`~pinsidecar.daemon.liveness` — the engine's exit watch and health probe;
- :mod:`~pinsidecar.daemon.boots` — boot records, and what a boot's engine log says (cache miss, pin refusal);
- :mod:`~pinsidecar.daemon.peers` — the supervisor's observer and gate protocols;
- :mod:`~pinsidecar.daemon.gate` — the reverse proxy that holds requests during a reboot;
- :mod:`~pinsidecar.daemon.control` — the control API (status, drain-reboot, remap);
- :mod:`~pinsidecar.daemon.map_library` — the watched folder of maps;
- :mod:`~pinsidecar.daemon.traffic_capture` — the opt-in store of request bodies (a workload for count boots);
- :mod:`~pinsidecar.daemon.sdnotify` — systemd's notify protocol.
"""
