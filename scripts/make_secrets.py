"""Write ``.env`` for docker-compose.yaml from ``.env.example``, every secret generated here (``make secrets``).

    python3 scripts/make_secrets.py [--template .env.example] [--output .env] [--force]

A variable of the template whose comment line above says ``generate: <kind>`` gets a fresh value: ``fernet``
(a Fernet key: 32 random bytes, URL-safe base64), ``token`` (64 hex characters), ``password`` (32 URL-safe
characters) or ``user`` (``pinflow-`` and 8 hex characters). Other variables keep the template's value. An existing
``.env`` is never overwritten without ``--force``: its Fernet key decrypts what Airflow already stored, and its
passwords are the ones the databases were created with. Standard library only (runs before ``make install``).
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import secrets
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GENERATORS = {
    "fernet": lambda: base64.urlsafe_b64encode(secrets.token_bytes(32)).decode(),
    "token": lambda: secrets.token_hex(32),
    "password": lambda: secrets.token_urlsafe(24),
    "user": lambda: f"pinflow-{secrets.token_hex(4)}",
}
_GENERATE = re.compile(r"^#.*\bgenerate:\s*(\w+)")
_ASSIGNMENT = re.compile(r"^([A-Z][A-Z0-9_]*)=(.*)$")


def render(template: str) -> str:
    """The template with a generated value for every ``generate:`` variable."""
    lines, kind = [], None
    for line in template.splitlines():
        if match := _GENERATE.match(line):
            kind = match.group(1)
            if kind not in GENERATORS:
                raise ValueError(f"unknown generator {kind!r} (known: {', '.join(GENERATORS)})")
        elif (match := _ASSIGNMENT.match(line)) and kind is not None:
            line = f"{match.group(1)}={GENERATORS[kind]()}"
            kind = None
        elif not line.startswith("#"):
            kind = None
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--template", type=Path, default=REPO / ".env.example")
    parser.add_argument("--output", type=Path, default=REPO / ".env")
    parser.add_argument("--force", action="store_true", help="replace an existing file (rotates every secret)")
    args = parser.parse_args(argv)
    if args.output.exists() and not args.force:
        print(f"{args.output} exists: kept (its secrets are the ones the stack was set up with; --force replaces it)")
        return 0
    text = render(args.template.read_text())
    descriptor = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as f:
        f.write(text)
    os.chmod(args.output, 0o600)
    print(f"wrote {args.output} with generated secrets (mode 0600; git-ignored)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
