"""The trainer's per-step JSONL log, and the model FLOPs and MFU it reports (aurakernel.flops)."""

from __future__ import annotations

import json
from pathlib import Path

from aurakernel.paths import write_text_atomic
from aurakernel.flops import attention_flops_per_token, flops_per_token, mfu, parameter_counts

__all__ = ["JsonlLog", "attention_flops_per_token", "flops_per_token", "mfu", "parameter_counts"]


class JsonlLog:
    """One JSON object per step, flushed each line so a killed run keeps its log. The log is the
    run's true history: opening it for a run that starts at `start_step` (0, or a resumed
    checkpoint's step) first drops the records of steps >= start_step, which a run killed after its
    last checkpoint (or an earlier run from scratch) left, and a line a kill cut short."""

    def __init__(self, path: str | None, start_step: int = 0):
        self.file = None
        if path:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            if start_step and path.is_file():
                lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
                write_text_atomic(path, "".join(line for line in lines
                                                if (step := _step(line)) is not None and step < start_step))
            self.file = open(path, "a" if start_step else "w", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def _step(line: str) -> int | None:
    """The step of a complete log line, None for one cut short or not ours."""
    if not line.endswith("\n"):
        return None
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None
