"""The Airflow layer: operators, task callables, retry policy and compute backends.

It turns Airflow context (data interval, params, team) into explicit arguments for ``features`` and
``training``, and it is the only layer that reads platform configuration (``core.config``).
"""
