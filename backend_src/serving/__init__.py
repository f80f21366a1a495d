"""Serving: the stages behind each Triton model (``stages/``), their request checks (``validation``),
the session cache (``session_store``), the durable event log (``event_log/``), the ranker's runtimes,
and the server's operation: ``server`` and ``server_cli`` (start, stop, status), ``processes``,
``access`` (the admin key), ``health`` and the ``watchdog`` with its keeper and the event log's
readiness probe (``log_probe``), ``redis_server`` and ``cluster`` (replicas behind nginx)."""
