"""What one load of a program found on this machine, kept for the next: the compiled
executables themselves, each cell's execution time, and the path its fast-path check
proved.

A warm load (the same program, cell, devices, versions and flags as a load before it)
reads them instead of lowering, fetching from jax's persistent cache, comparing the fast
path against the public one and timing the cell back to back. They live in the
per-user compilation cache directory, used only when nobody else can write to it or to
any directory above it (``safe_cache_dir``: its files are native code that will run,
like the persistent cache's own).

Every entry is stored under a key of everything that could change it and carries an
HMAC-SHA256 over its key and bytes, keyed by a random per-user key kept in the cache
directory (``KEY_FILE``, readable by its owner only): an entry that does not check out
is ignored, found again and rewritten. jax serializes an executable with pickle, so
only an entry whose HMAC checks out is unpickled: one written by anyone without the key
(a copied cache, a planted file) never is. A deserialized executable is run once before
it serves (its warm-up); if that fails, the cell is compiled as on a cold load.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import pickle
import secrets
import socket
import stat
from typing import Any

import jax

from . import artifact

TIMINGS = "timings"
EXECUTABLES = "executables"
KEY_FILE = "pxrt-hmac.key"
_MAGIC = b"pxrt-executable-2\n"  # (2: an HMAC, not a plain checksum)


# --------------------------------------------------------------------------- the directory


def safe_cache_dir(path: str) -> str:
    """``path`` (created if missing), checked as a place for files that will run: it and
    every directory above it (symlinks resolved) belong to this user or to root, and
    nobody else can write to them (a directory others may write to is fine only if it
    is sticky and root's, as /tmp: nobody can move another's entries there). Returns the
    real path; raises ``OSError`` saying which directory is not safe, and why."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    real = os.path.realpath(path)
    uid = os.getuid() if hasattr(os, "getuid") else None
    at = real
    while True:
        st = os.stat(at)
        mine = uid is None or st.st_uid == uid
        if at == real:
            if not mine or st.st_mode & 0o022:
                raise OSError(f"{path}: it belongs to another user or others can write to it")
        elif not (mine or st.st_uid == 0) or (
            st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and st.st_uid == 0)
        ):
            raise OSError(
                f"{path}: {at}, a directory above it, belongs to another user or others "
                "can write to it"
            )
        parent = os.path.dirname(at)
        if parent == at:
            return real
        at = parent


def _own_dir(cache_dir: str, folder: str, create: bool) -> str | None:
    """``cache_dir/folder`` if it is a directory of this user's that only it can write
    to, not a symlink (that could lead out of the cache); created when ``create``."""
    where = os.path.join(cache_dir, folder)
    if create:
        os.makedirs(where, mode=0o700, exist_ok=True)
    try:
        st = os.lstat(where)
    except OSError:
        return None
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022:
        return None
    return where


_KEYS: dict[str, bytes] = {}  # cache directory -> its key, once read


def _hmac_key(cache_dir: str) -> bytes | None:
    """The per-user key of ``cache_dir``'s entries: made once (32 random bytes, readable
    by this user only); None if the file there is not that (nothing is then trusted)."""
    key = _KEYS.get(cache_dir)
    if key is not None:
        return key
    path = os.path.join(cache_dir, KEY_FILE)
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    if not os.path.lexists(path):
        # Written whole under another name, then linked into place: a process or thread
        # that finds the file finds all of it (and one made meanwhile by another wins).
        tmp = os.path.join(cache_dir, f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | nofollow, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
        except OSError:
            return None
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    try:
        fd = os.open(path, os.O_RDONLY | nofollow)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        key = f.read()
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if st.st_uid != uid or st.st_mode & 0o077 or len(key) != 32:
        return None
    _KEYS[cache_dir] = key
    return key


def _read(cache_dir: str, folder: str, name: str) -> bytes | None:
    """An entry's bytes (None: missing, or not in a safe folder, or a symlink)."""
    where = _own_dir(cache_dir, folder, create=False)
    if where is None:
        return None
    try:
        fd = os.open(os.path.join(where, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def key(
    art: artifact.Artifact,
    devices: list,
    size: int,
    lengths: tuple[int, ...],
    what: str,
    zero_copy: bool,
) -> str:
    """The key of one stored fact ``what`` about one cell of ``art`` on ``devices``."""
    files = art.manifest.get("files", {})
    return key_of(
        {
            "program": files.get(artifact.PROGRAM_FILE, ""),
            "params": files.get(artifact.PARAMS_FILE, ""),
            "cell": [size, list(lengths)],
            "devices": device_fields(devices),
            "what": what,
            "zero_copy": zero_copy,
            "x64": art.x64,
        }
    )


def key_of(fields: dict, code: tuple = ()) -> str:
    """A key of ``fields`` plus what holds for everything stored here: the process's
    devices, this host, the versions, a hash of pxrt's execution paths (and of the
    modules in ``code``: the pxrt code a stored program was traced from) and
    ``XLA_FLAGS``."""
    import jaxlib

    from . import __version__

    fields = {
        **fields,
        "process": [jax.process_index(), jax.device_count(), jax.local_device_count()],
        "host": host_fingerprint(),
        "versions": [jax.__version__, jaxlib.__version__, __version__, code_fingerprint(code)],
        "flags": os.environ.get("XLA_FLAGS", ""),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def device_fields(devices: list) -> list:
    """The devices as a key holds them: platform, kind and id, in order."""
    return [[d.platform, getattr(d, "device_kind", ""), d.id] for d in devices]


@functools.cache
def code_fingerprint(modules: tuple = ()) -> str:
    """pxrt's own code that a stored fact depends on (the execution paths a proof
    covers, and ``modules``): a development tree edited under the same version number
    finds nothing stored by the code before the edit."""
    from . import _xla

    h = hashlib.sha256()
    for module in (_xla, *modules):
        path = getattr(module, "__file__", None)
        if path:
            try:
                with open(path, "rb") as f:
                    h.update(f.read())
            except OSError:
                pass
    return h.hexdigest()


@functools.cache
def host_fingerprint() -> str:
    """This host and its CPU's features: native code compiled for one machine does not
    run on another sharing the same home directory."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    return hashlib.sha256(
        f"{socket.gethostname()}|{os.uname().machine}|{flags}".encode()
    ).hexdigest()


# --------------------------------------------------------------------------- small facts


def read_entry(cache_dir: str | None, k: str) -> dict | None:
    """What is stored under ``k`` (None: nothing, or an entry that does not check out)."""
    if cache_dir is None:
        return None
    data = _read(cache_dir, TIMINGS, k + ".json")
    if data is None:
        return None
    try:
        doc = json.loads(data)
        value = doc["value"]
        check = _check(cache_dir, k, json.dumps(value, sort_keys=True))
        if doc["key"] != k or check is None or not hmac.compare_digest(doc["check"], check):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, dict) else None


def write_entry(cache_dir: str | None, k: str, value: dict) -> None:
    if cache_dir is None:
        return
    check = _check(cache_dir, k, json.dumps(value, sort_keys=True))
    if check is None:
        return
    doc = {"key": k, "value": value, "check": check}
    _write(cache_dir, TIMINGS, k + ".json", json.dumps(doc).encode())


def stored_time(cache_dir: str | None, k: str) -> float | None:
    """A cell's stored execution time in seconds (None: none that checks out)."""
    value = read_entry(cache_dir, k)
    exec_s = None if value is None else value.get("exec_s")
    if not isinstance(exec_s, float) or not 0 < exec_s < 3600:
        return None
    return exec_s


def stored_path(cache_dir: str | None, k: str) -> str | None:
    """The execution path a cell's fast-path check proved (None: none that checks out)."""
    value = read_entry(cache_dir, k)
    path = None if value is None else value.get("path")
    return path if path in ("call", "raw", "public") else None


# --------------------------------------------------------------------------- executables


def serializable(compiled: Any) -> bool:
    """Whether ``compiled`` can be stored: jax's ``serialize_executable`` takes no
    hoisted constants."""
    params = getattr(compiled, "_params", None)
    return not getattr(params, "const_args", None)


def store_executable(cache_dir: str | None, k: str, compiled: Any) -> bool:
    """Store a compiled executable under ``k``. Only an executable XLA compiled in this
    process may be stored: one fetched from jax's persistent cache serializes without
    its native code (it fails when run). One that jax cannot serialize is marked
    ``unstorable``: later loads fetch it from jax's cache instead. Returns whether it
    was written."""
    if cache_dir is None:
        return False
    from jax.experimental import serialize_executable

    try:
        if not serializable(compiled):
            raise ValueError("hoisted constants")
        payload = pickle.dumps(serialize_executable.serialize(compiled), protocol=5)
    except Exception:  # noqa: BLE001 - not storable: jax's persistent cache serves it
        write_entry(cache_dir, k, {"unstorable": True})
        return False
    check = _check(cache_dir, k, payload)
    if check is None:
        return False
    head = _MAGIC + check.encode() + b"\n"
    return _write(cache_dir, EXECUTABLES, k + ".bin", head + payload)


def unstorable(cache_dir: str | None, k: str) -> bool:
    """Whether the executable of ``k`` was found to be one jax cannot serialize."""
    value = read_entry(cache_dir, k)
    return bool(value and value.get("unstorable"))


def load_executable(cache_dir: str | None, k: str, devices: list) -> tuple[Any, bool]:
    """The executable stored under ``k``, loaded onto ``devices``, and whether one was
    refused: (None, False) when none is stored; (None, True) when its bytes do not
    check out or do not load (it is removed: the caller compiles the cell afresh and
    stores it again)."""
    if cache_dir is None:
        return None, False
    data = _read(cache_dir, EXECUTABLES, k + ".bin")
    if data is None:
        return None, False
    head_len = len(_MAGIC) + 65
    payload = data[head_len:]
    check = data[len(_MAGIC) : head_len - 1]
    want = _check(cache_dir, k, payload)
    if not data.startswith(_MAGIC) or want is None or not hmac.compare_digest(check, want.encode()):
        discard_executable(cache_dir, k)  # (never unpickled: not written with our key)
        return None, True
    from jax.experimental import serialize_executable

    try:
        serialized, in_tree, out_tree = pickle.loads(payload)
        compiled = serialize_executable.deserialize_and_load(
            serialized, in_tree, out_tree, execution_devices=devices
        )
    except Exception:  # noqa: BLE001 - compiled afresh and stored again
        discard_executable(cache_dir, k)
        return None, True
    return compiled, False


def discard_executable(cache_dir: str | None, k: str) -> None:
    if cache_dir is None:
        return
    try:
        os.unlink(os.path.join(cache_dir, EXECUTABLES, k + ".bin"))
    except OSError:
        pass


# --------------------------------------------------------------------------- files


def _check(cache_dir: str, k: str, payload: str | bytes) -> str | None:
    """The HMAC of an entry (None: the directory has no usable key; nothing is stored
    or trusted there)."""
    key = _hmac_key(cache_dir)
    if key is None:
        return None
    h = hmac.new(key, k.encode() + b":", hashlib.sha256)
    h.update(payload.encode() if isinstance(payload, str) else payload)
    return h.hexdigest()


def _write(cache_dir: str, folder: str, name: str, data: bytes) -> bool:
    try:
        where = _own_dir(cache_dir, folder, create=True)
        if where is None:
            return False  # (not a directory of ours: written nowhere)
        tmp = os.path.join(where, f".{name}.{os.getpid()}.{id(data)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                     0o600)  # fmt: skip
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(where, name))
    except OSError:
        return False  # found again next time
    return True
