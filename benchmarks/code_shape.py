"""The shape of the code issue 35 asks to measure before and after a redesign, for a checkout or a git revision.

Prints one JSON line: the lines of the four stage operators (and of their shared base, if there is one), the blocks
of six or more lines that the stage operators' files repeat between them (the ``duplicates`` tool, where it is
installed), and per 1,000 lines of ``operators/``, ``services/`` and ``training/``: ``Any`` and string-keyed look-ups
(``x["key"]``, ``x.get("key"``), and the imports inside functions in those folders.

    .venv/bin/python benchmarks/code_shape.py            # this checkout
    .venv/bin/python benchmarks/code_shape.py --rev eda65cb  # a revision (checked out to a temporary folder)
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("FeatureBuildOperator", "DistributedTrainingOperator", "CorpusScoringOperator", "HpoTrialOperator")
BASE = "ComputeJobOperator"
FOLDERS = ("operators", "services", "training")  # services/ was part of operators/ before 21ee1e0
STRING_KEY = re.compile(r"""\[\s*["'][A-Za-z_]\w*["']\s*\]|\.get\(\s*["'][A-Za-z_]\w*["']""")
ANY = re.compile(r"\bAny\b")


def class_file(root: Path, name: str) -> Path | None:
    """The module of ``operators/`` that defines class ``name`` (wherever a revision keeps it)."""
    for path in sorted((root / "operators").glob("*.py")):
        if f"class {name}(" in path.read_text():
            return path
    return None


def class_lines(root: Path, name: str) -> int | None:
    path = class_file(root, name)
    if path is None:
        return None
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return int(node.end_lineno or node.lineno) - node.lineno + 1
    return None


def imports_in_functions(tree: ast.AST) -> int:
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            count += sum(isinstance(child, (ast.Import, ast.ImportFrom)) for child in ast.walk(node))
    return count


def repeated_blocks(root: Path) -> int | None:
    """Pairs of places (6+ lines alike) between two different stage-operator files, boilerplate left out."""
    if shutil.which("duplicates") is None:
        return None
    files = {path.name for path in (class_file(root, name) for name in (*STAGES, BASE)) if path is not None}
    out = subprocess.run(["duplicates", "--repo", str(root / "operators"), "--most", "200", "--seconds", "60"],
                         capture_output=True, text=True, check=False).stdout
    pairs = 0
    for line in out.splitlines():
        match = re.match(r"\s*D\d+\s+(\S+?):\S+\s+~\s+(\S+?):\S+", line)
        if match and "boilerplate" not in line:
            a, b = Path(match.group(1)).name, Path(match.group(2)).name
            pairs += a != b and a in files and b in files
    return pairs


def measure(root: Path) -> dict[str, object]:
    stage_lines = {name: class_lines(root, name) for name in STAGES}
    lines = anys = keyed = nested = 0
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text()
            lines += text.count("\n")
            anys += len(ANY.findall(text))
            keyed += len(STRING_KEY.findall(text))
            nested += imports_in_functions(ast.parse(text))
    return {
        "stage_operator_lines": stage_lines,
        "stage_operator_lines_total": sum(v or 0 for v in stage_lines.values()),
        "base_lines": class_lines(root, BASE),
        "repeated_blocks_between_stage_operators": repeated_blocks(root),
        "lines_operators_training": lines,
        "any_per_1000_lines": round(1000 * anys / lines, 1),
        "string_keyed_lookups_per_1000_lines": round(1000 * keyed / lines, 1),
        "imports_inside_functions": nested,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", help="a git revision of this repository (default: the working tree)")
    args = parser.parse_args()
    if not args.rev:
        print(json.dumps({"rev": "working tree", **measure(REPO)}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        top = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", args.rev], capture_output=True,
                             text=True, check=True).stdout.split()
        folders = [folder for folder in FOLDERS if folder in top]  # services/ is newer than some revisions
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.rev, *folders], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        print(json.dumps({"rev": args.rev, **measure(Path(tmp))}))


if __name__ == "__main__":
    main()
