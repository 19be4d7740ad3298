"""How long each DAG file takes to parse, against a hello-world DAG parsed the same way in the same run.

The DAG processor parses each file in a child process forked from a parent that has Airflow imported, has frozen
its objects out of the garbage collector (``gc.freeze()`` in ``DagFileProcessorManager.before_run``) and has
imported the ``airflow`` modules the file names (``parsing_pre_import_modules``, on by default). Here each parse is
a fresh process that does the same first (not timed), then times ``DagBag`` over the one file: what the file
itself costs (its imports, the configuration, building the DAG). Without the freeze, every collection during the
parse also walks Airflow's own objects, which the DAG processor does not do. Each file is parsed ``--repeat``
times, alternating with the hello DAG; the median counts. Prints one JSON line: seconds per file and
``vs_hello`` per file (issue 35's bar: at most 2).

The DAG files read the configuration from a cache (``core.config_view``) filled by the first parse after it
changed: that one parse also builds the typed configuration.

    .venv/bin/python benchmarks/dag_parse.py [--repeat 7] [--pyc]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HELLO = '''
import pendulum
from airflow.sdk import DAG, task

with DAG(dag_id="hello", start_date=pendulum.datetime(2026, 11, 1, tz="UTC"), schedule="@daily", catchup=False):
    @task
    def hello() -> str:
        return "hello"

    hello()
'''
TIMER = '''
import gc, importlib, sys, time
import airflow, airflow.sdk  # noqa: F401  (the DAG processor's parent has these)
from airflow.dag_processing.dagbag import DagBag
from airflow.utils.file import iter_airflow_imports
gc.freeze()  # as DagFileProcessorManager.before_run, before it forks the parsing processes
for module in iter_airflow_imports(sys.argv[1]):  # as DagFileProcessorProcess.start (parsing_pre_import_modules)
    importlib.import_module(module)
start = time.perf_counter()
bag = DagBag(dag_folder=sys.argv[1])
elapsed = time.perf_counter() - start
assert bag.dags and not bag.import_errors, bag.import_errors
print(elapsed)
'''


def parse_seconds(path: Path, pycache: str | None = None) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if pycache:  # compiled modules kept (in a folder of their own), as a DAG processor that may write them
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    out = subprocess.run([sys.executable, "-c", TIMER, str(path)], capture_output=True, text=True, env=env, cwd=REPO,
                         check=True, timeout=300)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--pyc", action="store_true",
                        help="parse with the modules' bytecode cached (written by an untimed first parse of each "
                             "file): a DAG processor that may write __pycache__; without it, the environment's "
                             "way (PYTHONDONTWRITEBYTECODE=1: the repository's modules compiled at every parse)")
    args = parser.parse_args()
    files = sorted((REPO / "dags").glob("*.py"))
    with tempfile.TemporaryDirectory() as tmp:
        hello = Path(tmp) / "hello_dag.py"
        hello.write_text(HELLO)
        pycache = str(Path(tmp) / "pycache") if args.pyc else None
        for path in ([hello, *files] if pycache else []):
            parse_seconds(path, pycache)
        times: dict[str, list[float]] = {"hello": []}
        for _ in range(args.repeat):
            for path in files:
                times["hello"].append(parse_seconds(hello, pycache))
                times.setdefault(path.name, []).append(parse_seconds(path, pycache))
    median = {name: statistics.median(values) for name, values in times.items()}
    print(json.dumps({
        "repeat": args.repeat, "pyc": args.pyc, "seconds": {k: round(v, 4) for k, v in median.items()},
        "vs_hello": {k: round(v / median["hello"], 2) for k, v in median.items() if k != "hello"},
    }))


if __name__ == "__main__":
    main()
