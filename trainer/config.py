"""The one config object the trainer is wired by, loaded from YAML and checked key by key."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from aurakernel.errors import UserError
from aurakernel.paths import read_json_object, read_yaml_mapping


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
    grad_accum: int = 1                  # micro-batches of data.batch_size rows per optimizer step
    activation_checkpointing: bool = False   # recompute each decoder layer in backward
    checkpoint_dir: str | None = None    # DCP checkpoints step_N/ + a `latest` pointer; resumed from
    checkpoint_every: int = 0            # steps between checkpoints (0: only after the last step)
    keep_last: int | None = None         # complete checkpoints kept (the oldest pruned after a save); null: all
    max_bad_steps: int = 3               # consecutive non-finite steps (skipped) before the run stops
    balance_experts: bool = False        # aux-loss-free router bias updates (trainer/objectives.py)
    indexer_kl_weight: float = 0.0       # weight of the CSA indexer's KL alignment loss (0: off)
    model_dir: str | None = None         # start from this Hugging Face checkpoint (its config.json
                                         # replaces the model section)


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
    raw = read_yaml_mapping(path, "config")
    if ("model" not in raw and not (raw.get("train") or {}).get("model_dir")):
        raise UserError(f"config {path}: expected a mapping with a 'model' section (or train.model_dir)")
    unknown = sorted(set(raw) - {"model", "data", "train", "hardware"})
    if unknown:
        raise UserError(f"config {path}: unknown section(s) {', '.join(unknown)}: accepted are model, data, train, hardware")
    cfg = TrainConfig(
        model=dict(raw.get("model") or {}),
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
        _number(f"config {path}", f"data.{name}", getattr(cfg.data, name), integer=True, low=1)
    _check_train(cfg.train, f"config {path}")
    cfg.train.betas = tuple(cfg.train.betas)
    if cfg.train.model_dir:   # a checkpoint's config.json is transformers' to read (it may carry more)
        use_model_dir(cfg, cfg.train.model_dir)
    else:
        check_model_keys(cfg.model, f"config {path}")
    return cfg


def _number(source: str, name: str, value, *, integer: bool = False, low: float | None = None, low_open: bool = False,
            high: float | None = None, high_open: bool = False, nullable: bool = False, off: str = "") -> None:
    """One numeric setting in its range, or a one-line error naming the key, the value and the range."""
    if value is None and nullable:
        return
    kind = "an integer" if integer else "a number"
    lo = "" if low is None else f"{'>' if low_open else '>='} {low:g}"
    hi = "" if high is None else f"{'<' if high_open else '<='} {high:g}"
    wanted = f"{kind}{' ' + lo if lo else ''}{' and ' + hi if lo and hi else ' ' + hi if hi else ''}{off}"
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    ok = ok and not isinstance(value, bool) and value == value and value not in (float("inf"), float("-inf"))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise UserError(f"{source}: {name} must be {wanted}, got {value!r}")


def _check_train(t: TrainSettings, source: str) -> None:
    """The loop's keys: counts are integers, switches booleans, directories strings."""
    for name, low in (("steps", 1), ("grad_accum", 1), ("max_bad_steps", 1), ("checkpoint_every", 0)):
        _number(source, f"train.{name}", getattr(t, name), integer=True, low=low)
    for name in ("activation_checkpointing", "balance_experts"):
        if not isinstance(getattr(t, name), bool):
            raise UserError(f"{source}: train.{name} must be true or false, got {getattr(t, name)!r}")
    for name in ("checkpoint_dir", "model_dir"):
        value = getattr(t, name)
        if value is not None and not (isinstance(value, str) and value):
            raise UserError(f"{source}: train.{name} must be a directory path or null, got {value!r}")
    if t.log is not None and not (isinstance(t.log, str) and t.log):
        raise UserError(f"{source}: train.log must be a file path or null, got {t.log!r}")
    # the optimizer's and the schedule's numbers: a value out of range trains wrong without failing
    # (grad_clip -1 flips the gradients, lr 0 stops after a step), so each is checked here
    _number(source, "train.lr", t.lr, low=0, low_open=True)
    _number(source, "train.min_lr", t.min_lr, low=0, high=t.lr if _is_number(t.lr) else None, off=" (train.lr)")
    _number(source, "train.warmup_steps", t.warmup_steps, integer=True, low=0)
    _number(source, "train.weight_decay", t.weight_decay, low=0)
    _number(source, "train.grad_clip", t.grad_clip, low=0, low_open=True, nullable=True, off=", or null for no clipping")
    _number(source, "train.seed", t.seed, integer=True, low=0)
    _number(source, "train.keep_last", t.keep_last, integer=True, low=1, nullable=True, off=", or null to keep all")
    _number(source, "train.indexer_kl_weight", t.indexer_kl_weight, low=0)
    if not (isinstance(t.betas, list | tuple) and len(t.betas) == 2):
        raise UserError(f"{source}: train.betas must be two numbers in [0, 1), got {t.betas!r}")
    for i, b in enumerate(t.betas):
        _number(source, f"train.betas[{i}]", b, low=0, high=1, high_open=True)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def check_model_keys(model: dict, source: str) -> None:
    """The model section's keys are DeepseekV4Config's: a typo (vocab_sizee) would be dropped silently
    and the model built with the default, so an unknown key is an error naming its near miss."""
    import difflib

    from transformers import DeepseekV4Config, PretrainedConfig

    known = (set(DeepseekV4Config().to_dict()) | set(PretrainedConfig().to_dict()) | set(DeepseekV4Config.attribute_map)
             | _legacy_keys() | {"model_type", "architectures"})
    unknown = sorted(k for k in model if k not in known)
    if unknown:
        k = unknown[0]
        near = difflib.get_close_matches(k, sorted(known), n=1)
        raise UserError(f"{source}: unknown model key {k!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                        + ": the model section takes DeepseekV4Config's fields")


def _legacy_keys() -> set[str]:
    """The config.json names DeepseekV4Config still takes and folds into its fields (compress_ratios,
    num_hash_layers, ...): the ones its __post_init__ pops from its kwargs."""
    import inspect
    import re

    from transformers import DeepseekV4Config

    return set(re.findall(r'kwargs\.pop\(\s*"(\w+)"', inspect.getsource(DeepseekV4Config)))


def check_fits_memory(cfg: TrainConfig, source: str) -> None:
    """A batch whose logits alone (and their gradient: batch x seq x vocab fp32, twice) exceed this
    machine's memory cannot train: refused before the model is built, not by the OOM killer (the
    trainer calls it; a modeled profile on the meta device needs no memory)."""
    import os

    vocab = cfg.model.get("vocab_size")
    if not _is_number(vocab):
        return
    need = 2 * cfg.data.batch_size * cfg.data.seq_len * int(vocab) * 4
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > have:
        raise UserError(f"{source}: data.batch_size {cfg.data.batch_size} x data.seq_len {cfg.data.seq_len} needs "
                        f"{need / 2**30:.1f} GiB for the logits and their gradient alone (vocab {vocab}); this machine "
                        f"has {have / 2**30:.1f} GiB: lower batch_size (or use train.grad_accum)")


def use_model_dir(cfg: TrainConfig, model_dir: str) -> TrainConfig:
    """Train from a Hugging Face checkpoint directory: its config.json becomes the model section,
    so everything that reads cfg.model (dry run, FLOPs, profile) sees the checkpoint's architecture,
    and its tokenizer (if it has tokenizer files) is the data's unless data.tokenizer names another."""
    config_json = Path(model_dir) / "config.json"
    if not config_json.is_file():
        raise UserError(f"model dir {model_dir}: no config.json (expected a Hugging Face model directory)")
    model = read_json_object(config_json, "model config")
    cfg.model, cfg.train.model_dir = model, str(model_dir)
    from .data import TOKENIZER_FILES
    if cfg.data.tokenizer is None and any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        cfg.data.tokenizer = str(model_dir)
    return cfg
