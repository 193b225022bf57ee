"""Chat alerts: isolation commands and verdicts, grouped per host, posted to ops chat.

Data flow (each step its own small module)::

    consumer.py   c4.isolations + c4.verdicts  ->  decoded commands / verdicts
    grouping.py   one open alert per (job, host); de-duplicated; resolved after a quiet period
    routing.py    each notification to every destination whose min_severity it reaches
    delivery.py   one bounded queue + worker per destination; retries with back-off
    targets/      one module per chat format (Slack, Mattermost, Teams, DingTalk, Feishu,
                  Discord, Alertmanager webhook) behind one base class
    config.py     the typed TOML config; secrets redacted in repr and logs

:class:`sinks.alert.alerter.Alerter` wires grouping, routing and delivery together without
Kafka, so the same path runs in tests and in ``c4stream alert test``.
"""
