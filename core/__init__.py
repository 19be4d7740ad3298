"""The lowest layer, imported by all and importing none of them nor Airflow: storage, data contracts,
failure classes and the typed platform configuration (docs/architecture.md §1)."""
