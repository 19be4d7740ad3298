"""An Airflow notifier for tests: appends its rendered ``text`` to a file (what a Slack or SMTP notifier would send).

On the PYTHONPATH of the processes that run deadline callbacks (``operators.deadlines``): named in the configuration as
``deadlines.notifier: file_notifier.FileNotifier``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from airflow.sdk.bases.notifier import BaseNotifier


class FileNotifier(BaseNotifier):
    template_fields = ("text",)

    def __init__(self, path: str, text: str = "{{ pinflow_deadline.message }}") -> None:
        super().__init__()
        self.path, self.text = path, text

    async def async_notify(self, context: Any) -> None:
        with Path(self.path).open("a") as out:
            out.write(self.text + "\n")

    def notify(self, context: Any) -> None:
        with Path(self.path).open("a") as out:
            out.write(self.text + "\n")
