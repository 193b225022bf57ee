"""What every stage of c4stream shares, at the bottom of the layers.

Topic names, Kafka settings and topic creation, configuration loading, metrics, logs,
dead letters and the per-service start-up. It imports none of the stages
(``producers``, ``streams``, ``sinks``) nor the front end (``c4stream``): the layers
contract in ``pyproject.toml`` keeps it so.
"""
