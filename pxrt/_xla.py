"""The one module in pxrt that touches jax internals.

Everything here is either a public jax API or an internal one that jax itself has
called the same way since 0.4.30 (see ``docs/jax-runtime-notes.md``):

- ``xla_client.batched_device_put``: per-device host shards -> one sharded Array,
  skipping ``jax.device_put``'s Python slicing;
- ``LoadedExecutable.execute_sharded``: run with pre-flattened, resident params;
- ``ExecuteResults.disassemble_into_single_device_arrays``: per-device output
  shards, each readable as a zero-copy numpy view on CPU;
- ``jax._src.compilation_cache.reset_cache``: point jax's process-wide persistent
  cache at pxrt's cache directory for the duration of one load.

The raw path is only used after ``make_program`` proved, bucket by bucket, that it
gives bit-identical results to the public ``Compiled.__call__``; otherwise the bucket
runs through the public path (``PublicProgram``) and a warning says why.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import compilation_cache as _cc
from jax._src import config as _config
from jax._src.lib import jaxlib_extension_version as _EXT_VERSION
from jax._src.lib import xla_client as _xc

# The raw path was verified on this extension version only (jax/jaxlib 0.10.2).
# On another one every bucket takes the public path.
RAW_PATH_EXTENSION_VERSIONS = frozenset({467})
RAW_PATH_AVAILABLE = _EXT_VERSION in RAW_PATH_EXTENSION_VERSIONS

# Staging buffers start on this boundary so that XLA:CPU can alias them (zero copy).
STAGING_ALIGNMENT = 64

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


# --------------------------------------------------------------------------- compiles


class _CompileCounter:
    """Counts XLA backend compiles, and those that happen on pxrt's request path.

    jax reports every backend compile as a duration event on the compiling thread.
    Request-path code runs inside ``request_path(owner)``, which names the owner (a
    Model) for the current thread; a compile reported while an owner is set counts
    against it, in the owner's own ``request_path_compiles`` attribute (so the count
    lives and dies with its model). That count must stay 0 after load.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.total = 0
        self._registered = False

    def ensure_registered(self) -> None:
        with self._lock:
            if not self._registered:
                jax.monitoring.register_event_duration_secs_listener(self._on_event)
                jax.monitoring.register_event_listener(self._on_plain_event)
                self._registered = True

    def request_path(self, owner: object) -> _RequestPath:
        """``with compile_counter.request_path(model): ...``: compiles on this thread
        meanwhile count against ``model``."""
        return _RequestPath(self._local, owner)

    def on_this_thread(self) -> int:
        """XLA compiles so far on the calling thread that jax's persistent cache did not
        answer (jax reports a fetch from it as a compile too, and as a cache hit)."""
        local = self._local
        return getattr(local, "compiles", 0) - getattr(local, "cache_hits", 0)

    def _on_plain_event(self, event: str, **kwargs: Any) -> None:
        if event == _CACHE_HIT_EVENT:
            self._local.cache_hits = getattr(self._local, "cache_hits", 0) + 1

    def _on_event(self, event: str, duration_secs: float, **kwargs: Any) -> None:
        if event != _BACKEND_COMPILE_EVENT:
            return
        local = self._local
        local.compiles = getattr(local, "compiles", 0) + 1
        owner = getattr(local, "owner", None)
        with self._lock:
            self.total += 1
            if owner is not None:
                owner.request_path_compiles = getattr(owner, "request_path_compiles", 0) + 1


class _RequestPath:
    """The context manager of ``_CompileCounter.request_path`` (cheap: a few attribute
    writes, no generator)."""

    __slots__ = ("_local", "_owner", "_outer")

    def __init__(self, local: threading.local, owner: object) -> None:
        self._local = local
        self._owner = owner

    def __enter__(self) -> None:
        self._outer = getattr(self._local, "owner", None)
        self._local.owner = self._owner

    def __exit__(self, *exc: Any) -> None:
        self._local.owner = self._outer


compile_counter = _CompileCounter()


# --------------------------------------------------------------------------- scopes


def x64_scope(enabled: bool) -> contextlib.AbstractContextManager:
    """jax's x64 mode for this thread only; the caller's global config is untouched."""
    return jax.enable_x64(enabled)


@contextlib.contextmanager
def export_scope(x64: bool) -> Iterator[None]:
    """Tracing for ``jax.export``, on this thread: x64 as given, and source locations
    that do not depend on who called export. By default jax records each op's whole
    Python stack, the exporting script's file and line included, so the same model
    exported from two scripts gave two different programs (and missed the stored
    executables). Here an op keeps the innermost frame of the model's own code, its
    file name without the directory."""
    with (
        x64_scope(x64),
        _config.include_full_tracebacks_in_locations(False),
        _config.hlo_source_file_canonicalization_regex(r".*/"),
    ):
        yield


_persistent_cache_lock = threading.Lock()


@contextlib.contextmanager
def persistent_cache(path: str | None) -> Iterator[None]:
    """Use ``path`` as jax's persistent compilation cache for this thread's compiles.

    jax keeps one process-wide cache object, bound to a directory the first time it
    is used. We reset it on the way in and out so that pxrt's directory is used for
    this load only and the host's own cache setting comes back after.
    Entries are written however fast the compile was (jax's default skips compiles
    under one second, which on CPU is all of them).
    """
    if path is None:
        yield
        return
    with _persistent_cache_lock:
        _cc.reset_cache()
        try:
            with cache_settings(path):
                yield
        finally:
            _cc.reset_cache()


@contextlib.contextmanager
def cache_settings(path: str | None) -> Iterator[None]:
    """jax's settings for ``path`` as the compilation cache, on this thread: what a
    thread compiling for a load inside ``persistent_cache`` needs (jax's settings are
    per thread; the cache object they reach is the process's, bound by it)."""
    if path is None:
        yield
        return
    with (
        _config.enable_compilation_cache(True),
        _config.compilation_cache_dir(path),
        _config.persistent_cache_min_compile_time_secs(0.0),
    ):
        yield


def compile_here(
    lower: Callable[[], Any], x64: bool, cache_dir: str | None, afresh: bool = False
) -> tuple[Any, str]:
    """``lower().compile()`` on this thread with pxrt's settings: x64 as the artifact's,
    jax's persistent cache in ``cache_dir`` (bypassed with ``afresh``, so that the
    executable is XLA's own and can be stored). Returns (compiled, "compiled" or "cache":
    what the persistent cache or jax's memory answered)."""
    before = compile_counter.on_this_thread()
    with (
        x64_scope(x64),
        cache_settings(cache_dir),
        no_persistent_cache() if afresh else contextlib.nullcontext(),
    ):
        compiled = lower().compile()
    return compiled, "compiled" if compile_counter.on_this_thread() > before else "cache"


def no_persistent_cache() -> contextlib.AbstractContextManager:
    """Compile afresh on this thread, neither reading nor writing jax's persistent cache
    (an executable fetched from it cannot be stored again by ``pxrt.stored``)."""
    return _config.enable_compilation_cache(False)


# --------------------------------------------------------------------------- staging


def aligned_empty(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on STAGING_ALIGNMENT."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + STAGING_ALIGNMENT, np.uint8)
    offset = (-raw.ctypes.data) % STAGING_ALIGNMENT
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


class StagingSlot:
    """Host buffers for one batch: a full ``(bucket, ...)`` buffer per input, and
    per-device row views of it in the order the program puts them on devices.

    A zero-copy device buffer aliases these arrays, so a slot may only be refilled
    after the outputs of the batch that used it have been fetched.
    """

    __slots__ = ("buffers", "shards")

    def __init__(self, buffers: list[np.ndarray], row_slices: Sequence[slice]) -> None:
        self.buffers = buffers
        self.shards = [[buf[s] for s in row_slices] for buf in buffers]


# --------------------------------------------------------------------------- programs


class PublicProgram:
    """A bucket run through jax's public API: ``Compiled.__call__`` + ``np.asarray``."""

    path = "public"

    def __init__(self, compiled: jax.stages.Compiled, params_dev: Any, x64: bool, bucket: int):
        self.compiled = compiled
        self.params_dev = params_dev
        self.x64 = x64
        self.bucket = bucket
        # One full-size "shard": staging buffers go in whole, outputs come back whole.
        self.row_slices = [slice(0, bucket)]
        self.out_shard_rows = bucket

    def dispatch(self, slot: StagingSlot) -> Any:
        """Start the execution; returns a handle for ``fetch``."""
        with x64_scope(self.x64):
            return self.compiled(self.params_dev, *slot.buffers)

    def fetch(self, outs: Any) -> list[list[np.ndarray]]:
        """Wait for the outputs; per output, its shards (here one) as numpy arrays."""
        return [[np.asarray(o)] for o in outs]


class RawProgram:
    """A bucket run through the raw path: batched_device_put -> execute_sharded ->
    per-device output views. It validates nothing: callers hand it staging slots
    whose dtypes and shapes were fixed at load."""

    path = "raw"

    def __init__(
        self,
        compiled: jax.stages.Compiled,
        param_bufs: list,
        n_inputs: int,
        x64: bool,
        bucket: int,
        zero_copy: bool = True,
    ):
        # jax internals (docs/jax-runtime-notes.md): typed Any; verify-then-fallback
        # (``choose_program``) checks their behaviour at load.
        mesh_exe: Any = compiled._executable
        if compiled._params.const_args:
            raise _Unsupported("the executable has hoisted constants (const_args)")
        n_args = len(mesh_exe.in_avals)
        if sorted(mesh_exe._kept_var_idx) != list(range(n_args)):
            raise _Unsupported("some arguments were pruned from the executable")
        if n_args != len(param_bufs) + n_inputs:
            raise _Unsupported(f"expected {len(param_bufs) + n_inputs} arguments, got {n_args}")
        self.bucket = bucket
        exe = compiled.runtime_executable()
        if exe is None:
            raise _Unsupported("the compiled program has no runtime executable")
        self.exe = exe
        self.param_bufs = list(param_bufs)
        self.x64 = x64
        self.in_avals = list(mesh_exe.in_avals[-n_inputs:])
        self.in_shardings = list(mesh_exe._in_shardings[-n_inputs:])
        self.hbs = (
            _xc.HostBufferSemantics.ZERO_COPY
            if zero_copy
            else _xc.HostBufferSemantics.IMMUTABLE_ONLY_DURING_CALL
        )

        self.devices = list(self.exe.local_devices())
        index_map = self.in_shardings[0].addressable_devices_indices_map(self.in_avals[0].shape)
        self.row_slices = [_row_slice(index_map[d], bucket) for d in self.devices]
        for aval, sharding in zip(self.in_avals, self.in_shardings):
            m = sharding.addressable_devices_indices_map(aval.shape)
            if [_row_slice(m[d], bucket) for d in self.devices] != self.row_slices:
                raise _Unsupported("inputs are not all sharded the same way over the batch")

        # Output shards come back in the executable's device order; the result
        # handler wants them in row order, each holding out_shard_rows rows. (In a
        # multi-host group this process's devices hold the rows from ``first_row`` on.)
        out_avals = mesh_exe.out_avals
        out_shardings = mesh_exe._out_shardings
        self.out_shard_rows = bucket // len(self.in_shardings[0].device_set)
        self.first_row = min(s.start for s in self.row_slices)
        self.out_order: list[int] | None = None
        for aval, sharding in zip(out_avals, out_shardings):
            m = sharding.addressable_devices_indices_map(aval.shape)
            slices = [_row_slice(m[d], bucket) for d in self.devices]
            order = sorted(range(len(slices)), key=lambda i: slices[i].start)
            want = [
                slice(
                    self.first_row + i * self.out_shard_rows,
                    self.first_row + (i + 1) * self.out_shard_rows,
                )
                for i in range(len(slices))
            ]
            if [slices[i] for i in order] != want:
                raise _Unsupported("outputs are not split evenly over the batch dimension")
            if order != list(range(len(order))):
                self.out_order = order

    def put(self, slot: StagingSlot) -> list:
        return [
            _xc.batched_device_put(
                aval, sharding, shards, self.devices, True, False, self.hbs, self.x64
            )
            for aval, sharding, shards in zip(self.in_avals, self.in_shardings, slot.shards)
        ]

    def fetch(self, results: Any) -> list[list[np.ndarray]]:
        # Each single-device CPU output read as a read-only numpy view that keeps the
        # device buffer alive; this blocks until the execution has produced it. The C++
        # method is what np.asarray(jax.Array) ends in, minus ~15 us of Python on the way.
        per_output = results.disassemble_into_single_device_arrays()
        order = self.out_order
        if order is not None:
            per_output = [[shards[i] for i in order] for shards in per_output]
        return [[_to_numpy(a) for a in shards] for shards in per_output]

    def dispatch(self, slot: StagingSlot) -> Any:
        """Put the slot's shards on their devices and start the execution (async on
        CPU); returns a handle for ``fetch``."""
        return self.exe.execute_sharded(self.param_bufs + self.put(slot))


def _to_numpy_cpp(array: Any) -> np.ndarray:
    value, copied = array._single_device_array_to_np_array_did_copy()
    if value.flags.writeable:  # a copy, or a backend that hands out writeable views
        value.flags.writeable = False
    return value


_to_numpy = (
    _to_numpy_cpp if hasattr(jax.Array, "_single_device_array_to_np_array_did_copy") else np.asarray
)


class _Unsupported(Exception):
    """The raw path cannot run this executable; use the public one."""


def _row_slice(index: tuple, bucket: int) -> slice:
    start, stop, _ = index[0].indices(bucket)
    for other in index[1:]:
        if other != slice(None):
            raise _Unsupported("a non-batch dimension is sharded")
    return slice(start, stop)


class CallProgram(PublicProgram):
    """Single-device fast path: jax's C++ ``Compiled.__call__`` dispatch (as cheap as
    the raw path on one device), with outputs read through the C++ host view instead of
    ``np.asarray``'s Python (~10 us less per batch, measured side by side)."""

    path = "call"

    def dispatch(self, slot: StagingSlot) -> Any:
        if self.x64:
            with x64_scope(True):
                return self.compiled(self.params_dev, *slot.buffers)
        return self.compiled(self.params_dev, *slot.buffers)

    def fetch(self, outs: Any) -> list[list[np.ndarray]]:
        return [[_to_numpy(o)] for o in outs]


def make_program(
    compiled: jax.stages.Compiled,
    params_dev: Any,
    n_inputs: int,
    x64: bool,
    bucket: int,
    example: list[np.ndarray],
    *,
    fast_path: bool = True,
    zero_copy: bool = True,
    proven: str | None = None,
) -> PublicProgram | RawProgram:
    """The fastest program for one compiled bucket that is proven correct here.

    Builds the fast program (``CallProgram`` on one device, else ``RawProgram``) and runs
    it once against ``Compiled.__call__`` on the same ``example`` inputs (full
    ``(bucket, ...)`` buffers, one per input), which also warms both up. Any difference,
    or any failure, and the bucket takes the public path with a warning naming the reason.

    ``zero_copy`` lets device buffers alias the staging slots (64-byte aligned), so a
    slot may only be refilled after its batch's outputs were fetched: the staging ring
    enforces that. Without it, the put copies each shard during the call.

    ``proven``: the path an earlier load of this very program and cell on this machine
    proved (``"call"``, ``"raw"``, ``"public"``): it is built and run once, to warm it
    up, without the comparison (any failure, and the whole check runs as usual).
    """
    if proven is not None:
        program = proven_program(
            proven, compiled, params_dev, n_inputs, x64, bucket, example, zero_copy
        )
        if program is not None:
            return program
    public = PublicProgram(compiled, params_dev, x64, bucket)
    expected = _concat(run_program(public, StagingSlot(example, public.row_slices)))
    if not (fast_path and RAW_PATH_AVAILABLE):
        return public
    candidates: list[tuple[str, Any]] = []
    runtime = compiled.runtime_executable()
    if runtime is not None and len(runtime.local_devices()) == 1:
        candidates.append(("call", lambda: CallProgram(compiled, params_dev, x64, bucket)))
    candidates.append(
        (
            "raw",
            lambda: RawProgram(
                compiled, jax.tree.leaves(params_dev), n_inputs, x64, bucket, zero_copy
            ),
        )
    )
    reasons = []
    for name, make in candidates:
        try:
            program = make()
            got = _concat(run_program(program, StagingSlot(example, program.row_slices)))
        except Exception as exc:  # noqa: BLE001 - any failure means: not this path
            reasons.append(f"{name} path: {exc!r}")
            continue
        bad = [
            i
            for i, (g, e) in enumerate(zip(got, expected))
            if g.shape != e.shape or g.dtype != e.dtype or not _same_bits(g, e)
        ]
        if not bad:
            return program
        reasons.append(f"{name} path gave different outputs {bad}")
    warnings.warn(
        f"pxrt: bucket {bucket} uses jax's public call path; the fast paths failed their "
        f"check: {'; '.join(reasons)}",
        RuntimeWarning,
        stacklevel=3,
    )
    return public


def proven_program(
    path: str,
    compiled: Any,
    params_dev: Any,
    n_inputs: int,
    x64: bool,
    bucket: int,
    example: list[np.ndarray],
    zero_copy: bool = True,
) -> Any:
    """The program of the path ``path`` an earlier check proved for this very program
    and cell, run once on ``example`` to warm it up (None: not a path this build can
    make, or the run failed)."""
    program = _path_program(path, compiled, params_dev, n_inputs, x64, bucket, zero_copy)
    if program is None:
        return None
    try:
        run_program(program, StagingSlot(example, program.row_slices))
    except Exception:  # noqa: BLE001 - the caller proves or compiles it again
        return None
    return program


def _path_program(
    path: str,
    compiled: Any,
    params_dev: Any,
    n_inputs: int,
    x64: bool,
    bucket: int,
    zero_copy: bool,
) -> Any:
    try:
        if path == "public":
            return PublicProgram(compiled, params_dev, x64, bucket)
        if path == "call" and RAW_PATH_AVAILABLE:
            return CallProgram(compiled, params_dev, x64, bucket)
        if path == "raw" and RAW_PATH_AVAILABLE:
            return RawProgram(
                compiled, jax.tree.leaves(params_dev), n_inputs, x64, bucket, zero_copy
            )
    except Exception:  # noqa: BLE001 - prove it again
        return None
    return None


def run_program(program: Any, slot: StagingSlot) -> list[list[np.ndarray]]:
    """Run a program once on ``slot``, synchronously."""
    return program.fetch(program.dispatch(slot))


def time_program(
    program: Any, slot: StagingSlot, runs: int = 3, budget_s: float = 0.025, most: int = 50
) -> float:
    """Median seconds of one execution of ``program`` on ``slot``, back to back (after
    the conformance check has warmed it up): at least ``runs`` runs, more (up to
    ``most``) while they fit in ``budget_s``, so that cheap cells, whose times the
    serving policy compares with each other, are not decided by one noisy sample (a
    0.5 ms cell runs 50 times, a 5 ms one 5, a 50 ms one 3; one over 100 ms, twice)."""
    times: list[float] = []
    spent = 0.0
    while (len(times) < runs and spent < 8 * budget_s) or (spent < budget_s and len(times) < most):
        t0 = time.perf_counter()
        run_program(program, slot)
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return float(np.median(times))


def _concat(per_output: list[list[np.ndarray]]) -> list[np.ndarray]:
    return [np.concatenate(shards) if len(shards) > 1 else shards[0] for shards in per_output]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
