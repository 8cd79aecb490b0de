"""The one config object the trainer is wired by, loaded from YAML and checked key by key."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from aurakernel.errors import UserError


@dataclass
class DataConfig:
    source: str = "synthetic"       # synthetic | text | jsonl | sft (see trainer/data.py)
    path: str | None = None
    seq_len: int = 256
    batch_size: int = 4             # rows per process; the global batch is batch_size * world size
    tokenizer: str | None = None    # a checkpoint/tokenizer directory; null: byte-level tokens


@dataclass
class TrainSettings:
    steps: int = 20
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 2
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    dtype: str = "fp32"
    log: str | None = None


@dataclass
class HardwareSettings:
    target: str = "host"


@dataclass
class TrainConfig:
    model: dict
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainSettings = field(default_factory=TrainSettings)
    hardware: HardwareSettings = field(default_factory=HardwareSettings)
    path: str = ""


def _section(cls, raw: dict | None, name: str, source: str):
    raw = raw or {}
    if not isinstance(raw, dict):
        raise UserError(f"{source}: section '{name}' must be a mapping")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise UserError(f"{source}: unknown key(s) {', '.join(unknown)} in '{name}': accepted are {', '.join(sorted(known))}")
    obj = cls(**raw)
    for f in fields(cls):
        value = getattr(obj, f.name)
        default = getattr(cls(), f.name)
        if value is not None and default is not None and isinstance(default, int | float) and not isinstance(default, bool):
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise UserError(f"{source}: '{name}.{f.name}' must be a number, got {value!r}")
    return obj


def load_config(path: str | Path) -> TrainConfig:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config {path}: no such file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(raw, dict) or "model" not in raw:
        raise UserError(f"config {path}: expected a mapping with a 'model' section")
    unknown = sorted(set(raw) - {"model", "data", "train", "hardware"})
    if unknown:
        raise UserError(f"config {path}: unknown section(s) {', '.join(unknown)}: accepted are model, data, train, hardware")
    cfg = TrainConfig(
        model=dict(raw["model"]),
        data=_section(DataConfig, raw.get("data"), "data", str(path)),
        train=_section(TrainSettings, raw.get("train"), "train", str(path)),
        hardware=_section(HardwareSettings, raw.get("hardware"), "hardware", str(path)),
        path=str(path),
    )
    if cfg.data.source not in ("synthetic", "text", "jsonl", "sft"):
        raise UserError(f"config {path}: data.source {cfg.data.source!r}: accepted are synthetic, text, jsonl, sft")
    if cfg.data.tokenizer is not None and not isinstance(cfg.data.tokenizer, str):
        raise UserError(f"config {path}: data.tokenizer must be a directory path or null, got {cfg.data.tokenizer!r}")
    if cfg.data.source != "synthetic" and not cfg.data.path:
        raise UserError(f"config {path}: data.source {cfg.data.source} needs data.path")
    if cfg.train.dtype not in ("fp32", "bf16"):
        raise UserError(f"config {path}: train.dtype {cfg.train.dtype!r}: accepted are fp32, bf16")
    for name in ("seq_len", "batch_size"):
        if int(getattr(cfg.data, name)) < 1:
            raise UserError(f"config {path}: data.{name} must be >= 1")
    cfg.train.betas = tuple(cfg.train.betas)
    return cfg
