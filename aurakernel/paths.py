"""Where AuraKernel finds its own files and keeps its caches (XDG cache dir, content-hash keyed)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES_DIR = REPO_ROOT / "templates"
PROFILES_DIR = REPO_ROOT / "profiles"


def cache_dir() -> Path:
    """Root of every cache; AURAKERNEL_CACHE_DIR overrides (tests point it at a temp dir)."""
    root = os.environ.get("AURAKERNEL_CACHE_DIR") or platformdirs.user_cache_dir("aurakernel")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_db_path() -> Path:
    return Path(os.environ.get("AURAKERNEL_DB") or cache_dir() / "tuning.sqlite")
