"""Where AuraKernel finds its own files and keeps its caches (XDG cache dir, content-hash keyed)."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path

import platformdirs

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES_DIR = REPO_ROOT / "templates"
PROFILES_DIR = REPO_ROOT / "profiles"


def write_text_atomic(path: Path, text: str) -> Path:
    """Write a text file so that it holds either its old or its new content, never half of it
    (a temp file beside it, then an atomic rename): a killed process loses nothing."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")   # its own: writers may race
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def check_writable(path: str | Path, what: str, directory: bool = False) -> Path:
    """An output path a command will write (a file, or a directory it fills), checked before the
    expensive work starts: not the other kind of thing, not read-only, under a writable directory."""
    from .errors import UserError
    p = Path(path)
    if directory and p.exists() and not p.is_dir():
        raise UserError(f"{what} {p}: exists and is not a directory")
    if not directory and p.is_dir():
        raise UserError(f"{what} {p}: is a directory (expected a file path)")
    if p.exists() and not os.access(p, os.W_OK | (os.X_OK if directory else 0)):
        raise UserError(f"{what} {p}: is read-only")
    existing = p if directory and p.exists() else p.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{what} {p}: cannot be written ({existing} is not a writable directory)")
    # os.access does not stop root, nor see a read-only mount or a pseudo file system (/proc): make a
    # folder of our own where the command's first folder or file would go, then take it away. Its
    # name is unique, so the ranks of a torchrun job, which all check the same path at once, never
    # take away a folder another rank is probing
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".aurakernel-probe-"))
    except OSError as exc:
        raise UserError(f"{what} {p}: cannot be written ({existing}: {exc.strerror})") from None
    return p


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


STALE_BUILD_S = 3600.0   # a build's temp dir older than this belongs to a build that was killed
_swept: set[Path] = set()


def build_cache(kind: str) -> Path:
    """cache_dir()/kind, where builds land (each compiles in a temp dir there, then renames its
    output into place). The temp dirs of builds killed mid-way are removed, once per process."""
    import shutil
    import time

    path = cache_dir() / kind
    path.mkdir(parents=True, exist_ok=True)
    if path not in _swept:
        _swept.add(path)
        now = time.time()
        for tmp in path.glob("tmp*"):
            try:
                if tmp.is_dir() and now - tmp.stat().st_mtime > STALE_BUILD_S:
                    shutil.rmtree(tmp, ignore_errors=True)
            except OSError:   # another process removed it first
                pass
    return path


def whole_build(path: Path) -> bool:
    """Whether a cached executable or shared library is whole: an ELF file whose section header
    table (the linker writes it last) lies inside the file. A damaged one (truncated, emptied) is
    removed, so the caller builds it again instead of failing on it every run."""
    import struct

    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    whole = len(head) == 64 and head[:4] == b"\x7fELF" and head[4] == 2   # a 64-bit ELF file
    if whole:
        (sh_offset,), (sh_entsize, sh_num) = struct.unpack_from("<Q", head, 0x28), struct.unpack_from("<HH", head, 0x3A)
        whole = 0 < sh_offset and sh_offset + sh_entsize * sh_num <= size
    if not whole:
        path.unlink(missing_ok=True)
    return whole


def default_db_path() -> Path:
    return Path(os.environ.get("AURAKERNEL_DB") or cache_dir() / "tuning.sqlite")
