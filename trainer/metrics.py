"""The trainer's per-step JSONL log, and the model FLOPs and MFU it reports (aurakernel.flops)."""

from __future__ import annotations

import json
from pathlib import Path

from aurakernel.flops import attention_flops_per_token, flops_per_token, mfu, parameter_counts

__all__ = ["JsonlLog", "attention_flops_per_token", "flops_per_token", "mfu", "parameter_counts"]


class JsonlLog:
    """Appends one JSON object per step; flushed each line so a killed run keeps its log."""

    def __init__(self, path: str | None):
        self.file = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()
