"""Data contracts, validation, feature computation and the synthetic world. No Airflow imports."""
