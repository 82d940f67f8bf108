"""What one load of a program found on this machine, kept for the next: the compiled
executables themselves, each cell's execution time, and the path its fast-path check
proved.

A warm load (the same program, cell, devices, versions and flags as a load before it)
reads them instead of lowering, fetching from jax's persistent cache, comparing the fast
path against the public one and timing the cell back to back. They live in the
per-user compilation cache directory, which ``executable._cache_dir`` only uses when
nobody else can write to it (its files are native code that will run, like the
persistent cache's own).

Every entry is stored under a key of everything that could change it and carries a
checksum over its key and bytes: an entry that does not check out is ignored, found
again and rewritten. A deserialized executable is run once before it serves (its
warm-up); if that fails, the cell is compiled as on a cold load.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import socket
from typing import Any

import jax

from . import artifact

TIMINGS = "timings"
EXECUTABLES = "executables"
_MAGIC = b"pxrt-executable-1\n"


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
    try:
        with open(os.path.join(cache_dir, TIMINGS, k + ".json")) as f:
            doc = json.load(f)
        value = doc["value"]
        if doc["key"] != k or doc["check"] != _check(k, json.dumps(value, sort_keys=True)):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, dict) else None


def write_entry(cache_dir: str | None, k: str, value: dict) -> None:
    if cache_dir is None:
        return
    doc = {"key": k, "value": value, "check": _check(k, json.dumps(value, sort_keys=True))}
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
    head = _MAGIC + _check(k, payload).encode() + b"\n"
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
    path = os.path.join(cache_dir, EXECUTABLES, k + ".bin")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None, False
    head_len = len(_MAGIC) + 65
    payload = data[head_len:]
    check = data[len(_MAGIC) : head_len - 1]
    if not data.startswith(_MAGIC) or check != _check(k, payload).encode():
        discard_executable(cache_dir, k)
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


def _check(k: str, payload: str | bytes) -> str:
    h = hashlib.sha256(k.encode() + b":")
    h.update(payload.encode() if isinstance(payload, str) else payload)
    return h.hexdigest()


def _write(cache_dir: str, folder: str, name: str, data: bytes) -> bool:
    where = os.path.join(cache_dir, folder)
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
        tmp = os.path.join(where, f".{name}.{os.getpid()}.{id(data)}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(where, name))
    except OSError:
        return False  # found again next time
    return True
