"""Where AuraKernel finds its own files and keeps its caches (XDG cache dir, content-hash keyed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import platformdirs

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES_DIR = REPO_ROOT / "templates"
PROFILES_DIR = REPO_ROOT / "profiles"


def write_text_atomic(path: Path, text: str) -> Path:
    """Write a text file so that it holds either its old or its new content, never half of it
    (a temp file beside it, then an atomic rename): a killed process loses nothing."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def read_json_object(path: str | Path, what: str) -> dict:
    """A JSON file that must hold an object, or a one-line UserError naming `what` and the path
    (missing file, not JSON, not an object)."""
    from .errors import UserError
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path}: no such file")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        why = f"{exc.msg} at line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else exc.reason
        raise UserError(f"{what} {path}: not valid JSON ({why})") from None
    if not isinstance(data, dict):
        raise UserError(f"{what} {path}: expected a JSON object")
    return data


def read_yaml_mapping(path: str | Path, what: str) -> dict:
    """A YAML file that must hold a mapping, or a one-line UserError naming `what` and the path."""
    import yaml

    from .errors import UserError
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"{what} {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"{what} {path}: expected a YAML mapping")
    return data


def cache_dir() -> Path:
    """Root of every cache; AURAKERNEL_CACHE_DIR overrides (tests point it at a temp dir). One that
    cannot be a writable directory is a one-line error naming it."""
    from .errors import UserError

    override = os.environ.get("AURAKERNEL_CACHE_DIR")
    path = Path(override or platformdirs.user_cache_dir("aurakernel"))
    where = "AURAKERNEL_CACHE_DIR" if override else "the cache dir (XDG_CACHE_HOME)"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"{where} {path}: not a directory (set AURAKERNEL_CACHE_DIR to a writable directory)") from None
    except OSError as exc:
        raise UserError(f"{where} {path}: cannot be created ({exc.strerror}); set AURAKERNEL_CACHE_DIR to a "
                        "writable directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{where} {path}: not writable (set AURAKERNEL_CACHE_DIR to a writable directory)")
    return path


def default_db_path() -> Path:
    return Path(os.environ.get("AURAKERNEL_DB") or cache_dir() / "tuning.sqlite")
