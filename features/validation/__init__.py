"""The data validation gate of the raw datasets (docs/architecture.md §2, §3), one module per job.

- ``checks`` — the ``Check`` record and the storage and physical-schema stage (pyarrow);
- ``derived`` — the checks GX cannot express on the raw columns (references to another dataset, links
  between rows, nested values), computed as columns the suite then judges;
- ``suite`` — the Great Expectations suite as code, run on the partition as one dataframe;
- ``history`` — the partition's profile compared with the trailing validated days;
- ``report`` — the report folder (``result.json``, ``index.html``, ``profile.json``, GX Data Docs) and the
  quarantine of a failed partition;
- ``window`` — the days of a feature window without validated raw events;
- ``partition`` — ``validate_partition``, which runs the stages in order and writes the report.

The command line is ``python -m features.validate``. Every location is a ``core.storage`` string: a local
path, a ``file://`` URL or an fsspec URL (``s3://bucket/prefix``). Great Expectations is imported only inside
the functions that run it: Airflow imports these modules when a task starts, and importing GX takes seconds.
"""
