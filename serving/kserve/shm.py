"""Triton's system shared memory extension: tensors a client on the same host leaves in
POSIX shared memory instead of sending them over the socket. Off unless the server
allows it (``pxrt serve --allow-client-shm``, Triton's flag; ``Server(allow_client_shm=True)``).

A client creates a segment (``shm_open``: ``tritonclient.utils.shared_memory``), registers
a window of it under a name (``register(name, key, offset, byte_size)``: HTTP
``POST /v2/systemsharedmemory/region/{name}/register``, gRPC
``SystemSharedMemoryRegister``), then names the region in an inference request's input
or output ``parameters`` (``shared_memory_region``, ``shared_memory_byte_size``,
``shared_memory_offset``): an input is read from the region where the request says, an
output is written there and answered without its bytes (its name, datatype and shape
only, as Triton answers it).

What is checked, so a request never reads or writes outside what was registered:

- a key names one segment of ``/dev/shm`` (no path: ``/name`` or ``name``), opened
  without following links, a regular file; the window must lie inside it. pxrt's own
  segments (``OWN_PREFIX``: a ``--workers`` server's tensors, of any pxrt process) are
  refused, and so is a registration from another host (not loopback) unless the server
  allows it (``--allow-remote-shm``): such a client cannot use the memory, only reach
  into this host's;
- an input's or output's ``[offset, offset + byte_size)`` must lie inside its region, and
  an input's byte size must be its tensor's (an output's must hold it);
- a client that shrinks its segment cannot crash the server: each use checks the
  segment's size, and a shrink *while* a request reads or writes the mapping (which
  would be SIGBUS) is caught (``_shmguard``: the mapping becomes zeros, marked broken):
  that request is a 400 naming the region, its neighbours in the batch are answered,
  and the region is refused from then on. Without the Cython extensions, regions are
  read and written through the segment's descriptor instead (a copy per read);
- an unregistered region is gone for every request that comes after; a request that
  already holds its inputs keeps the mapping alive until it is answered (the memory is
  unmapped when the last view goes, never under a request), and its outputs are
  refused if their region was unregistered meanwhile.

With ``--restricted-api shared-memory:HEADER=VALUE``, registering, unregistering and
status need the key, and so does an inference request that names a region. A region
belongs to the key that registered it: with several keys for the group (the flag
repeated with other values), each key has its own names, and another key's regions do
not exist for it (it cannot use, replace, unregister or list them).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from pxrt._ext import twin

from ..access import Forbidden, Restrictions
from .codec import ProtocolError

_guard = twin("serving.kserve._shmguard", "serving.kserve._shmguard_py")
#: How many mappings broke under a request since the process started (``_shmguard``):
#: while 0, no answered request needs its inputs checked again.
faults: Callable[[], int] = _guard.faults

GROUP = "shared-memory"  # the restricted API group (``serving.access``)
ROOT = "/dev/shm"  # where shm_open's segments are, on Linux
MAX_REGIONS = 1024  # regions registered at once (each holds a mapping or a descriptor)
# How every pxrt process names the segments it makes itself (``serving.workers.ipc``: a
# --workers server's tensors): never a client's to register.
OWN_PREFIX = "pxrt-ipc-"

# What a server says without the extension.
OFF = (
    "system shared memory is off on this server: start pxrt serve with --allow-client-shm "
    "(Server(allow_client_shm=True))"
)
# What a --workers server says to every use of shared memory.
WORKERS = (
    "system shared memory is not served with --workers (a registration and the requests "
    "that use it would reach different processes): serve without --workers to use it"
)

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"


class RegionError(ProtocolError):
    """A bad region: already registered, outside its segment... (HTTP 400, gRPC
    INVALID_ARGUMENT)."""


class UnknownRegion(RegionError):
    """A region nobody registered (HTTP 404, gRPC NOT_FOUND, as Triton's)."""


@dataclasses.dataclass(eq=False)
class Region:
    """A registered window of a segment: ``byte_size`` bytes from ``offset`` of ``key``,
    ``mapping`` (from ``start``: mappings start page-aligned) guarded by ``_shmguard``
    in ``slot``; without the extensions, no mapping: read and written through ``fd``."""

    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap | None
    start: int  # where the window begins in ``mapping``
    slot: int = -1
    fd: int = -1
    registered: bool = True
    # Stops guarding the mapping, once (when it is unmapped: ``_unmap``, or its last view
    # going).
    unguard: Callable[[], Any] | None = dataclasses.field(default=None, repr=False)

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}  # fmt: skip

    def _shrunk(self, what: str) -> RegionError:
        return RegionError(
            f"{what}: shared memory region {self.name!r}'s segment {self.key!r} no longer "
            f"holds bytes {self.offset}..{self.offset + self.byte_size} (it was shrunk)"
        )

    def _window(self, offset: int, size: int, what: str) -> int:
        """The mapping's offset of ``[offset, offset + size)`` of the region, checked."""
        if offset < 0 or size < 0 or offset + size > self.byte_size:
            raise RegionError(
                f"{what}: bytes {offset}..{offset + size} are outside shared memory region "
                f"{self.name!r} ({self.byte_size} bytes)"
            )
        try:  # the segment's size now
            held = self.mapping.size() if self.mapping is not None else os.fstat(self.fd).st_size
        except (OSError, ValueError):
            held = -1
        if self.offset + self.byte_size > held or _guard.broken(self.slot):
            raise self._shrunk(what)
        return self.start + offset

    def read(self, offset: int, dtype: np.dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
        """The tensor at ``offset`` of the region: a view (no copy; without the
        extensions, a copy read through the descriptor)."""
        count = 1
        for d in shape:
            count *= d
        at = self._window(offset, count * dtype.itemsize, what)
        if self.mapping is not None:
            return np.frombuffer(self.mapping, dtype, count, at).reshape(shape)
        out = np.empty(shape, dtype)
        try:
            got = os.preadv(self.fd, [cast(Any, out)], self.offset + offset) if out.nbytes else 0
        except OSError:
            got = -1
        if got != out.nbytes:  # (shrunk since the check)
            raise self._shrunk(what)
        return out

    def write(self, offset: int, size: int, arr: np.ndarray, what: str) -> None:
        """``arr``'s bytes at ``offset`` of the region, which has ``size`` bytes for it."""
        if not self.registered:
            raise RegionError(
                f"{what}: shared memory region {self.name!r} was unregistered while the request ran"
            )
        data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        if data.nbytes > size:
            raise RegionError(
                f"{what}: the output has {data.nbytes} bytes; shared_memory_byte_size gives {size}"
            )
        at = self._window(offset, size, what)
        if self.mapping is not None:
            np.frombuffer(self.mapping, np.uint8, data.nbytes, at)[:] = data
            if _guard.broken(self.slot):  # shrunk while written: the bytes went nowhere
                raise self._shrunk(what)
        elif data.nbytes:
            # (through the descriptor, a segment shrunk since the check grows back, which
            # cannot fault; the client that shrank it gets its bytes, or its 400 next time)
            os.pwrite(self.fd, cast(Any, data), self.offset + offset)


@dataclasses.dataclass(frozen=True, slots=True)
class Placed:
    """An output a request asks to be written to a region (``requested_outputs``' second
    field, where other outputs have whether they go as binary data)."""

    region: Region
    offset: int
    byte_size: int

    def write(self, name: str, arr: np.ndarray) -> None:
        """Write output ``name`` (its answer then describes it without data, as
        Triton's: no parameters over HTTP, an empty raw contents over gRPC, which
        Triton's C++ client, perf_analyzer's, requires)."""
        self.region.write(self.offset, self.byte_size, arr, f"output {name!r}")


# The guarded mappings by id: their region's name, key and guard slot, for the views of
# them that requests hold (kept until the mapping goes, which may be after its region).
_MAPPED: dict[int, tuple[str, str, int]] = {}


def _mapped(arr: Any) -> tuple[str, str, int] | None:
    """What ``arr`` is a view of, if of a region's mapping (the client's memory)."""
    base = arr
    while type(base) is np.ndarray:
        base = base.base
    if type(base) is memoryview:
        base = base.obj
    return _MAPPED.get(id(base)) if type(base) is mmap.mmap else None


def check_read(inputs: Mapping[str, Any]) -> None:
    """Refuse a request that read an input from a region whose segment shrank under it
    (read as zeros: ``_shmguard``), once it ran: only it, not its batch."""
    if not _MAPPED:
        return
    for name, arr in inputs.items():
        seen = _mapped(arr)
        if seen is not None and _guard.broken(seen[2]):
            region, key, _ = seen
            raise RegionError(
                f"input {name!r}: shared memory region {region!r}'s segment {key!r} was "
                "shrunk while the request read it"
            )


def private(inputs: Mapping[str, Any]) -> Mapping[str, Any]:
    """``inputs`` with those in a client's shared memory copied (the same mapping when
    none is): what a response cache hashes must be what runs, and the client can
    rewrite its region until the batch reads it."""
    if not _MAPPED or not any(_mapped(arr) is not None for arr in inputs.values()):
        return inputs
    out = dict(inputs)
    for name, arr in inputs.items():
        if _mapped(arr) is not None:
            out[name] = arr.copy()
    check_read(inputs)  # (a copy of a segment shrunk meanwhile is zeros)
    return out


def local_peer(host: Any) -> bool:
    """Whether a client at ``host`` (its IP address as a string; None: not known) is on
    this host: a loopback address."""
    if not isinstance(host, str):
        return False
    try:
        address = ipaddress.ip_address(host.strip("[]").partition("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # (::ffff:127.0.0.1)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


class SharedMemory:
    """The regions registered with a server (``Server.shared_memory``), for every front
    end: HTTP and gRPC share them. ``unavailable``: why this process serves none (a
    ``--workers`` worker: its requests and registrations would meet different tables),
    said to every request that names one. ``allow_remote``: take registrations from
    clients on other hosts too (``--allow-remote-shm``).

    Each region has an owner: the key of the ``shared-memory`` API group that
    registered it (None: the group is open); an owner sees only its own regions
    (``for_request`` gives a request's view)."""

    def __init__(
        self, unavailable: str | None = None, root: str = ROOT, allow_remote: bool = False
    ) -> None:
        self.unavailable = unavailable
        self.root = root
        self.allow_remote = allow_remote
        self._regions: dict[tuple[Any, str], Region] = {}  # (owner, name) -> region
        self._lock = threading.Lock()  # (registrations may come from several loops)
        self.open = Regions(self)

    def _refuse(self) -> None:
        if self.unavailable:
            raise RegionError(self.unavailable)

    def register(
        self,
        name: Any,
        key: Any,
        offset: Any,
        byte_size: Any,
        owner: Any = None,
        local: bool = True,
    ) -> None:
        """Map ``byte_size`` bytes from ``offset`` of segment ``key`` as ``owner``'s
        region ``name``; ``local``: whether the client is on this host."""
        self._refuse()
        if not local and not self.allow_remote:
            raise Forbidden(
                f"region {name!r:.80}: shared memory is registered from this host only "
                "(a client on another host cannot use it, only reach into this host's): "
                "connect over loopback, or start pxrt serve with --allow-remote-shm"
            )
        if not isinstance(name, str) or not name or len(name) > 256:
            raise RegionError(
                f"a region's name must be a string of 1 to 256 characters, got {name!r:.80}"
            )
        for field, value in (("offset", offset), ("byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RegionError(
                    f"region {name!r}: {field} must be a non-negative integer, got {value!r:.40}"
                )
        if byte_size == 0:
            raise RegionError(f"region {name!r}: byte_size must be at least 1")
        path = self._path(name, key)
        with self._lock:
            if (owner, name) in self._regions:
                raise RegionError(f"shared memory region {name!r} is already registered")
            if len(self._regions) >= MAX_REGIONS:
                raise RegionError(
                    f"{MAX_REGIONS} shared memory regions are registered, the most a server "
                    "holds: unregister some first"
                )
            self._regions[owner, name] = _map(name, key, path, offset, byte_size)

    def _path(self, name: str, key: Any) -> str:
        bare = key[1:] if isinstance(key, str) and key.startswith("/") else key
        if (
            not isinstance(bare, str)
            or not bare
            or len(bare) > 255
            or "/" in bare
            or "\0" in bare
            or bare in (".", "..")
        ):
            raise RegionError(
                f"region {name!r}: key must name a shared memory segment ('/name', as "
                f"shm_open takes it), got {key!r:.80}"
            )
        if bare.startswith(OWN_PREFIX):
            raise RegionError(
                f"region {name!r}: segment {key!r:.80} is one of pxrt's own (a --workers "
                f"server's tensors: {OWN_PREFIX}*), not a client's"
            )
        return os.path.join(self.root, bare)

    def unregister(self, name: str | None = None, owner: Any = None) -> None:
        """Forget ``owner``'s region ``name`` (None: every region of ``owner``; one not
        registered: nothing to do, as Triton's, so a client's cleanup never fails)."""
        self._refuse()
        with self._lock:
            if name is None:
                gone = [k for k in self._regions if k[0] == owner]
            else:
                gone = [(owner, name)] if (owner, name) in self._regions else []
            regions = [self._regions.pop(k) for k in gone]
        for region in regions:
            _unmap(region)

    def status(self, name: str | None = None, owner: Any = None) -> list[dict[str, Any]]:
        """``owner``'s region ``name``'s registration (None: every region's)."""
        self._refuse()
        with self._lock:
            if name is None:
                return [r.status() for (o, _), r in self._regions.items() if o == owner]
            region = self._regions.get((owner, name))
        if region is None:
            raise UnknownRegion(f"no shared memory region {name!r} is registered")
        return [region.status()]

    def region(self, name: Any, what: str, owner: Any = None) -> Region:
        """``owner``'s registered region ``name``, for ``what`` (an input or output, in
        messages)."""
        self._refuse()
        region = self._regions.get((owner, name)) if isinstance(name, str) else None
        if region is None:
            raise UnknownRegion(f"{what}: no shared memory region {name!r:.80} is registered")
        return region

    def close(self) -> None:
        """Forget every owner's regions."""
        if not self.unavailable:
            with self._lock:
                regions = list(self._regions.values())
                self._regions.clear()
            for region in regions:
                _unmap(region)

    def for_request(self, restrictions: Restrictions, values: Callable[[str], list]) -> Regions:
        """The regions a request may use: with ``values`` (its header values by lower-case
        name) showing a key of the ``shared-memory`` group, when that group is
        restricted: that key's regions."""
        if GROUP not in restrictions.keys:
            return self.open
        return Regions(self, lambda: restrictions.holder(GROUP, values))


class Regions:
    """The registry as one request sees it: its owner's regions, once the request has
    shown a key of the ``shared-memory`` API group (``holder``: which key, or
    ``Forbidden``), if the group needs one."""

    __slots__ = ("holder", "registry")

    def __init__(self, registry: SharedMemory, holder: Callable[[], Any] | None = None) -> None:
        self.registry = registry
        self.holder = holder

    def owner(self) -> Any:
        return self.holder() if self.holder is not None else None

    def register(self, name: Any, key: Any, offset: Any, byte_size: Any, local: bool) -> None:
        self.registry.register(name, key, offset, byte_size, self.owner(), local)

    def unregister(self, name: str | None = None) -> None:
        self.registry.unregister(name, self.owner())

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        return self.registry.status(name, self.owner())

    def region(self, name: Any, what: str) -> Region:
        return self.registry.region(name, what, self.owner())

    def tensor(self, params: Any, dtype: np.dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
        """An input's tensor, from the region its ``params`` name (a dict: JSON's
        parameters; gRPC's are made into one)."""
        region = self.region(params.get(REGION), what)
        size = _int(params, BYTE_SIZE, what, None)
        offset = _int(params, OFFSET, what, 0)
        count = 1
        for d in shape:
            count *= d
        if size != count * dtype.itemsize:
            raise RegionError(
                f"{what}: shape {list(shape)} of {dtype} needs {count * dtype.itemsize} bytes, "
                f"{BYTE_SIZE} says {size}"
            )
        return region.read(offset, dtype, shape, what)

    def placed(self, params: Any, what: str) -> Placed:
        """Where an output goes, from its ``params``."""
        region = self.region(params.get(REGION), what)
        size = _int(params, BYTE_SIZE, what, None)
        offset = _int(params, OFFSET, what, 0)
        region._window(offset, size, what)
        return Placed(region, offset, size)


def no_cuda_region(name: str | None, register: bool = False) -> None:
    """CUDA shared memory (Triton's other extension), which pxrt does not serve: no region
    is ever registered, so status lists none and unregistering every one succeeds (as
    perf_analyzer does on start and exit); a register, or a name, is refused."""
    if register:
        raise RegionError(
            f"CUDA shared memory region {name!r:.80} cannot be registered: pxrt serves "
            "system shared memory (/v2/systemsharedmemory), not CUDA's"
        )
    if name is not None:
        raise UnknownRegion(
            f"no CUDA shared memory region {name!r:.80} is registered: pxrt serves system "
            "shared memory (/v2/systemsharedmemory), not CUDA's"
        )


def _int(params: Any, key: str, what: str, default: int | None) -> int:
    value = params.get(key, default)
    if value is None:
        raise RegionError(f"{what}: names a shared memory region without {key}")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RegionError(f"{what}: {key} must be a non-negative integer, got {value!r:.40}")
    return value


def _map(name: str, key: str, path: str, offset: int, byte_size: int) -> Region:
    """Map ``[offset, offset + byte_size)`` of the segment at ``path``, guarded (without
    the extensions: keep its descriptor)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise RegionError(
            f"region {name!r}: cannot open shared memory segment {key!r}: {exc.strerror}"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RegionError(f"region {name!r}: {key!r} is not a shared memory segment")
        if offset + byte_size > info.st_size:
            raise RegionError(
                f"region {name!r}: segment {key!r} has {info.st_size} bytes; offset {offset} + "
                f"byte_size {byte_size} goes past its end"
            )
        if not _guard.PROTECTS:
            region = Region(name, key, offset, byte_size, None, 0, fd=fd)
            weakref.finalize(region, os.close, fd)  # (a Placed may outlive the unregister)
            fd = -1
            return region
        start = offset % mmap.ALLOCATIONGRANULARITY
        try:
            mapping = mmap.mmap(fd, start + byte_size, offset=offset - start)
        except (OSError, ValueError) as exc:  # (shrunk since the fstat: mmap checks again)
            raise RegionError(
                f"region {name!r}: cannot map segment {key!r}'s bytes {offset}.."
                f"{offset + byte_size}: {exc}"
            ) from None
    finally:
        if fd >= 0:
            os.close(fd)
    slot = _guard.protect(mapping)
    if slot < 0:
        mapping.close()
        raise RegionError(
            f"region {name!r}: {_guard.SLOTS} shared memory mappings are held (regions, and "
            "unregistered ones that requests still read): unregister some first"
        )
    _MAPPED[id(mapping)] = (name, key, slot)
    # Guarded until the mapping is unmapped: at the unregister, or once the last view a
    # request holds goes (a finalizer runs once: the slot is not released twice).
    unguard = weakref.finalize(mapping, _forget, id(mapping), slot)
    return Region(name, key, offset, byte_size, mapping, start, slot, unguard=unguard)


def _forget(ident: int, slot: int) -> None:
    del _MAPPED[ident]
    _guard.release(slot)


def _unmap(region: Region) -> None:
    """``region`` is no longer registered: unmapped now, or when requests' views go."""
    region.registered = False
    mapping = region.mapping
    if mapping is None:
        return
    try:
        mapping.close()
    except BufferError:  # a request still views it: unmapped when the views go
        return
    if region.unguard is not None:
        region.unguard()


__all__ = [
    "Placed", "Region", "RegionError", "Regions", "SharedMemory", "UnknownRegion", "check_read",
    "local_peer", "private",
]  # fmt: skip
