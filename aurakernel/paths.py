"""Where AuraKernel finds its own files and keeps its caches (XDG cache dir, content-hash keyed)."""

from __future__ import annotations

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


def cache_dir() -> Path:
    """Root of every cache; AURAKERNEL_CACHE_DIR overrides (tests point it at a temp dir)."""
    root = os.environ.get("AURAKERNEL_CACHE_DIR") or platformdirs.user_cache_dir("aurakernel")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_db_path() -> Path:
    return Path(os.environ.get("AURAKERNEL_DB") or cache_dir() / "tuning.sqlite")
