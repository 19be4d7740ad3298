"""The assets that chain the DAGs (data-aware scheduling). Logical URIs: the storage root is config."""

from __future__ import annotations

from airflow.sdk import Asset

# "x-" schemes skip provider URI normalisers (which would import boto3 at parse time).
# A day of training examples is complete (emitted by pin_daily_features).
EXAMPLES_ASSET = Asset(name="pinflow_examples", uri="x-pinflow://examples")
# A model version was promoted to champion (emitted by pin_ranker_training).
CHAMPION_MODEL_ASSET = Asset(name="pinflow_champion_model", uri="x-pinflow://models/pin_ranker/champion")
# Corpus scores of a model version were published (emitted by pin_corpus_inference).
CORPUS_SCORES_ASSET = Asset(name="pinflow_corpus_scores", uri="x-pinflow://inference/pin_ranker")
