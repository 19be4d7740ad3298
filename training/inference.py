"""Batch inference over the pin corpus, one shard per process: ``python -m training.inference``.

Every pin of the ``raw/pins`` snapshot of ``ds`` with ``pin_id % num_shards == shard`` is scored by the
registered model of any family that scores the corpus: the model's feature spec names its family, whose
``score_corpus`` (``training.sdk``) turns a slice of the snapshot into rows of its ``corpus_schema`` (the
ranker: each pin's prior engagement probabilities in a non-personalised context; the content model:
``p_unsafe``, the topic distribution and the content embedding).

The shard is written to ``<out-dir>/part-{shard:05d}.parquet`` in one atomic write (``core.storage``: a
local temporary file and a rename, or one PUT on S3); a shard whose part exists is skipped, so a rerun
only scores what is missing. One JSON line on stdout reports the shard. :func:`publish_manifest`
(``--publish``) writes ``_MANIFEST.json`` last, once every part is there. Exit codes as
``core.failures.ExitCode``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core import storage
from core.contracts import RAW_PINS
from core.failures import DataError, ExitCode, exit_code_for
from training.runtime import setup_logging

log = logging.getLogger("training.inference")

MANIFEST = "_MANIFEST.json"
# The columns of the pin snapshot a family's score_corpus may read.
PIN_COLUMNS = ["pin_id", "embedding", "category", "creator_id", "image_embedding", "text_tokens"]


def part_name(shard: int) -> str:
    return f"part-{shard:05d}.parquet"


def load_model(model_uri: str, tracking_uri: str) -> tuple[Any, dict[str, Any]]:
    """The exported serving module and its feature spec (from the MLflow model's metadata)."""
    import mlflow
    import mlflow.pytorch

    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    info = mlflow.models.get_model_info(model_uri)
    spec = (info.metadata or {}).get("feature_spec")
    if not spec:
        raise ValueError(f"model {model_uri} has no feature_spec in its metadata: was it logged by training.train?")
    return mlflow.pytorch.load_model(model_uri), spec


def shard_pins(root: str, ds: str, shard: int, num_shards: int) -> Iterator[pa.Table]:
    """The pins of the shard, one row group of the snapshot at a time."""
    try:
        files = storage.data_files(root, RAW_PINS, ds)
    except FileNotFoundError as e:
        raise DataError(str(e)) from None
    for path in files:
        with storage.parquet_file(path) as parquet:
            for rg in range(parquet.num_row_groups):
                table = parquet.read_row_group(rg, columns=[c for c in PIN_COLUMNS if c in parquet.schema_arrow.names])
                keep = np.mod(table.column("pin_id").to_numpy(), num_shards) == shard
                if keep.any():
                    yield table.filter(pa.array(keep))


def score_shard(
    *,
    model_uri: str,
    tracking_uri: str,
    root: str,
    ds: str,
    shard: int,
    num_shards: int,
    out_dir: str | os.PathLike[str],
    batch_size: int = 4096,
) -> dict[str, Any]:
    """Score one shard into ``out_dir/part-{shard:05d}.parquet`` (skipped if it exists); return a summary."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in [0, {num_shards})")
    started = time.monotonic()
    final = storage.join(out_dir, part_name(shard))
    summary: dict[str, Any] = {"shard": shard, "num_shards": num_shards, "ds": ds, "path": final}
    if storage.exists(final):
        with storage.parquet_file(final) as done:
            return {**summary, "rows": done.metadata.num_rows, "skipped": True, "seconds": 0.0}

    from training.sdk import load_family

    module, spec = load_model(model_uri, tracking_uri)
    family = load_family(str(spec.get("family", "pin_ranker")), str(spec.get("family_module", "")),
                         spec.get("params"))
    schema = family.corpus_schema
    if schema is None:
        raise ValueError(f"model {model_uri} is of family {family.name}, which does not score the corpus")
    parts = [
        family.score_corpus(module, table.slice(start, batch_size), spec, root, ds)
        for table in shard_pins(root, ds, shard, num_shards)
        for start in range(0, table.num_rows, batch_size)
    ]
    result = pa.concat_tables(parts) if parts else schema.empty_table()
    buffer = pa.BufferOutputStream()
    pq.write_table(result, buffer)
    storage.write_bytes(final, buffer.getvalue().to_pybytes())
    return {**summary, "rows": result.num_rows, "skipped": False, "seconds": round(time.monotonic() - started, 3)}


def publish_manifest(out_dir: str | os.PathLike[str], num_shards: int, model_uri: str, ds: str) -> dict[str, Any]:
    """Check that every part exists, count the rows, and write ``_MANIFEST.json`` last (atomically).

    Readers treat the output as present only once the manifest is there. Raises FileNotFoundError
    naming the missing parts.
    """
    missing = [part_name(i) for i in range(num_shards) if not storage.exists(storage.join(out_dir, part_name(i)))]
    if missing:
        raise FileNotFoundError(
            f"cannot publish {out_dir}: {len(missing)} of {num_shards} part(s) missing ({', '.join(missing[:10])}); "
            "score those shards first"
        )
    parts = []
    columns: list[str] = []
    for i in range(num_shards):
        with storage.parquet_file(storage.join(out_dir, part_name(i))) as part:
            parts.append({"file": part_name(i), "rows": part.metadata.num_rows})
            columns = part.schema_arrow.names
    manifest = {
        "ds": ds,
        "model_uri": model_uri,
        "num_shards": num_shards,
        "parts": parts,
        "rows": sum(p["rows"] for p in parts),
        "columns": columns,
        "created": dt.datetime.now(dt.UTC).isoformat(),
    }
    storage.write_json(storage.join(out_dir, MANIFEST), manifest)
    return manifest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.inference",
        description=(__doc__ or "").split("\n\n")[0],
        epilog=(__doc__ or "").split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model-uri", required=True, help="MLflow model URI, e.g. models:/pin_ranker/3 (any family)")
    parser.add_argument("--tracking-uri", help="MLflow tracking and registry URI (required unless --publish)")
    parser.add_argument("--root", help="storage root holding raw/pins (required unless --publish)")
    parser.add_argument("--ds", required=True, help="day of the raw/pins snapshot (YYYY-MM-DD)")
    parser.add_argument("--shard", type=int, help="this shard's index in [0, num-shards)")
    parser.add_argument("--num-shards", type=int, required=True, help="pins with pin_id %% N == shard are scored")
    parser.add_argument("--out-dir", required=True, help="folder of the part files and the manifest")
    parser.add_argument("--batch-size", type=int, default=4096, help="pins per forward pass")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument(
        "--publish", action="store_true", help="do not score: check every part exists and write _MANIFEST.json"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(0)
    try:
        if args.publish:
            manifest = publish_manifest(args.out_dir, args.num_shards, args.model_uri, args.ds)
            print(json.dumps({k: v for k, v in manifest.items() if k != "parts"}), flush=True)
            return int(ExitCode.OK)
        if args.shard is None or not args.tracking_uri or not args.root:
            parser.error("--shard, --tracking-uri and --root are required to score a shard")
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        summary = score_shard(
            model_uri=args.model_uri,
            tracking_uri=args.tracking_uri,
            root=args.root,
            ds=args.ds,
            shard=args.shard,
            num_shards=args.num_shards,
            out_dir=args.out_dir,
            batch_size=args.batch_size,
        )
        print(json.dumps(summary), flush=True)
        return int(ExitCode.OK)
    except Exception as exc:
        code = exit_code_for(exc)
        log.error("inference failed (%s, exit %d): %s", code.name, int(code), exc, exc_info=exc)
        return int(code)


if __name__ == "__main__":
    sys.exit(main())
