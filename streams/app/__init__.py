"""The Faust worker of c4stream: events in, verdicts and isolation commands out.

Run it with ``c4stream worker [--config FILE] [--bootstrap HOST:PORT] [--topic-prefix P]
[--workdir DIR]`` or, from Python, :func:`streams.worker.run_worker` (blocking) /
:func:`streams.worker.start_worker_process` (child process with a readiness wait).

Modules, in the order data flows:

- :mod:`.settings` — :class:`WorkerConfig`, the one typed config (batching, checkpoint
  interval, timeouts, web server off or on 127.0.0.1) and its TOML loader;
- :mod:`.topics_admin` — pre-creates every topic with its partition count (pipeline
  topics, table changelogs, the internal watermark topic);
- :mod:`.faust_app` — ``make_app(config)``: the ``faust.App`` (none at import time);
- :mod:`.agents` — agent ``detect`` on ``c4.events`` and agent ``correlate`` on
  ``c4.verdicts``, the 1-second timer, rebalance and shutdown hooks, ``status.json``;
- :mod:`.runner` — what both agents' runners share: output, counters, and the restore /
  checkpoint / flush cycle of keyed state;
- :mod:`.detect_runner` — agent ``detect``'s broker-free logic (``CommRouter``), one
  consumer batch through: :mod:`.column_intake` (every message into one block of
  columns; corroboration), :mod:`.admission` (the contract's rules and the edge limits),
  :mod:`.comm_slices` (event-time slices per lane, judged together), :mod:`.comm_state`
  (a communicator's detector and its checkpoint envelope);
- :mod:`.correlate_runner` — agent ``correlate``'s: the host correlator behind a watermark,
  its state checkpointed per job (:mod:`.correlate_jobs`), the rails across jobs
  (:mod:`.host_rails`);
- :mod:`.watermark` — the watermark's wire format and its sender in agent ``detect``;
- :mod:`.faust_adapter` — the one module that reads Faust's private consumer fields, and
  the Faust worker with a bounded stop;
- :mod:`.checkpoint` — checkpoints every N events / S seconds into Faust tables;
- :mod:`.deadletter` — dead-letter records with ``topic[partition]@offset`` sources;
- :mod:`.engine` — the small protocol the agents need from :mod:`streams.core`;
- the broker watchdog (exit 3), the stop deadline (exit 4) and the repeated-log limit
  are the runtime the sinks share (:mod:`c4base.lifeguard`, :mod:`c4base.throttle`;
  docs/runtime.md).

Restarts and rebalances: a communicator's detector is checkpointed (``to_bytes``) to
the ``comm-state`` table, on the partition its events came from, every
``checkpoint_every_events`` events or ``checkpoint_every_s`` seconds, and on revocation
and clean stop; the next owner restores it with ``from_bytes`` the first time it sees
that communicator. A crash loses at most one checkpoint interval of detector state.
Checkpoint bytes are versioned msgpack (:mod:`streams.core.checkpoint`), never
unpickled; bytes the core refuses (corrupt, foreign, a forged pickle) go to
``c4.deadletter`` and that communicator (or correlator) starts afresh.
"""

from streams.app.settings import WorkerConfig, WorkerConfigError, load_worker_config

__all__ = ["WorkerConfig", "WorkerConfigError", "load_worker_config"]
