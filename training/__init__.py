"""Everything that runs on the compute nodes: model, data, distributed loop, evaluation, inference.

No Airflow import: the same ``python -m training.<cmd>`` runs locally, in AWS Batch or in Kubernetes.
"""
