"""Airflow local settings, imported by every Airflow process before it opens the metadata database.

Airflow puts the plugins folder on ``sys.path`` and imports ``airflow_local_settings`` from there. This one
makes the SQLite metadata database of the embedded default safe for concurrent writers (see
``services/metadata_db.py``); on PostgreSQL it changes nothing.
"""

from services import metadata_db

metadata_db.install()
