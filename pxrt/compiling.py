"""What every loader shares (``pxrt.executable`` for models, ``pxrt.generate`` for
decoders, ``pxrt.multihost`` for a group's processes): the cells of a bucket grid, the
per-device-group ``Instance`` that compiles, proves and warms them, the memory check
before anything is placed, the compilation-cache directory and the progress bar.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from . import _xla, artifact, shapes, stored
from .dispatch import lane_key


def example_inputs(
    specs: Mapping[str, artifact.TensorSpec],
    rows: int,
    seed: int = 0,
    lengths: Mapping[str, int] | None = None,
) -> dict[str, np.ndarray]:
    """Deterministic, non-trivial inputs of ``rows`` rows for the given specs, with
    named dimensions at ``lengths``."""
    rng = np.random.default_rng(seed)
    out = {}
    lengths = lengths or {}
    for name, spec in specs.items():
        missing = [d for d in spec.dims if d not in lengths]
        if missing:
            raise ValueError(f"input {name!r}: give lengths for its named dimensions {missing}")
        shape = (rows,) + spec.at(lengths)
        dt = spec.dtype
        if dt == np.bool_:
            out[name] = rng.random(shape) < 0.5
        elif np.issubdtype(dt, np.integer):
            info = np.iinfo(dt)
            out[name] = rng.integers(
                max(info.min, -1000), min(info.max, 1000), shape, endpoint=True
            ).astype(dt)
        else:
            out[name] = rng.standard_normal(shape).astype(dt)
    return out


def staged_example(
    specs: Mapping[str, artifact.TensorSpec], size: int, at: dict[str, int]
) -> list[np.ndarray]:
    """``example_inputs`` for a whole cell, in staging-aligned buffers (one per input,
    in order), as a program runs them."""
    out = []
    for spec, value in zip(specs.values(), example_inputs(specs, size, size, at).values()):
        buf = _xla.aligned_empty(value.shape, spec.dtype)
        buf[...] = value
        out.append(buf)
    return out


@dataclasses.dataclass(frozen=True)
class Settings:
    """What ``load`` was asked for, beyond the devices and cells."""

    art: artifact.Artifact
    cache_dir: str | None
    fast_path: bool
    zero_copy: bool
    staging_depth: int
    compile_workers: int | None
    progress: bool | None
    #: Timing keys of the cells this load timed (``auto``'s probe loads come first):
    #: their stored times are this load's own, not an earlier one's.
    timed_here: set = dataclasses.field(default_factory=set)


class Instance:
    """One device group of a load: its mesh, params and jitted program; compiles,
    checks and warms cells for it."""

    def __init__(self, settings: Settings, devices: list) -> None:
        art = settings.art
        self.settings = settings
        self.devices = devices
        mesh = Mesh(np.array(devices), (artifact.BATCH_AXIS,))
        replicated = NamedSharding(mesh, P())
        self.rows = NamedSharding(mesh, P(artifact.BATCH_AXIS))
        params_sh = jax.tree.map(lambda _: replicated, art.params)
        self.params_dev = jax.device_put(art.params, params_sh)
        self.param_specs = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), art.params
        )

        def jitted(program: Any) -> Any:
            return jax.jit(
                program.call,
                in_shardings=(params_sh,) + (self.rows,) * len(art.inputs),
                out_shardings=(self.rows,) * len(art.outputs),
                keep_unused=True,
            )

        # One program for every cell, or (concrete shapes) one per cell.
        programs = art.programs if art.programs is not None else {None: art.exported}
        self.jitted = {cell: jitted(p) for cell, p in programs.items()}

    def key(self, cell: Any, what: str) -> str:
        """The stored key of ``what`` about ``cell`` (a ``Cell`` or ``Bucket``) here."""
        return stored.key(
            self.settings.art, self.devices, cell.size, cell.lengths, what, self.settings.zero_copy
        )

    def compile_cell(
        self, size: int, lengths: tuple[int, ...], afresh: bool = False
    ) -> tuple[Any, str]:
        """Lower and compile one cell: (compiled, "compiled", or "cache" when jax's
        persistent cache had it; ``afresh``: not from that cache, so that the executable
        can be stored)."""
        art, cache_dir = self.settings.art, self.settings.cache_dir
        at = dict(zip(art.dim_buckets, lengths))
        x_specs = [
            jax.ShapeDtypeStruct((size,) + s.at(at), s.dtype, sharding=self.rows)
            for s in art.inputs.values()
        ]
        jitted = self.jitted[(size, *lengths) if art.programs is not None else None]
        try:
            return _xla.compile_here(
                lambda: jitted.lower(self.param_specs, *x_specs), art.x64, cache_dir, afresh
            )
        except Exception as exc:
            where = f" at {at}" if at else ""
            raise ValueError(f"{art.name!r}: bucket {size}{where} does not compile: {exc}") from exc

    def prepare(self, size: int, lengths: tuple[int, ...], timed: bool) -> Cell:
        """One cell, on the pool's threads: its executable (stored, or compiled), and its
        program: proven before and warmed up (a warm cell), or checked against the
        public path (a cold one). ``timed``: read its stored time (the instance whose
        cells are timed). Lowering holds the GIL; XLA's compile, loading a stored
        executable and running one release it."""
        settings = self.settings
        art, cache_dir, fast_path = settings.art, settings.cache_dir, settings.fast_path
        tc = time.perf_counter()
        cell = Cell(size, lengths)
        cell.compiled, cell.source = obtain(
            cache_dir,
            self.key(cell, "executable"),
            self.devices,
            lambda afresh: self.compile_cell(size, cell.lengths, afresh),
        )
        cell.obtain_s = time.perf_counter() - tc
        cell.example = staged_example(art.inputs, size, dict(zip(art.dim_buckets, lengths)))
        cell.proven = stored.stored_path(cache_dir, self.key(cell, f"proof:{fast_path}"))
        if cell.proven is not None and timed:
            cell.exec_s = stored.stored_time(cache_dir, self.key(cell, cell.proven))
        if cell.proven is not None and (cell.exec_s is not None or not timed):
            cell.program = self._warm(cell)  # a warm cell: its one warm-up run, here
            if cell.program is None and cell.source == "stored":
                # The stored executable does not run: compile it afresh, store it.
                self._recompile(cell)
                cell.program = self._warm(cell)
        if cell.program is None:  # a cold cell: its fast path checked, here too
            cell.program = self._checked(cell)
            if cell.proven != cell.program.path:
                stored.write_entry(
                    cache_dir, self.key(cell, f"proof:{fast_path}"), {"path": cell.program.path}
                )
            if timed:
                cell.exec_s = stored.stored_time(cache_dir, self.key(cell, cell.program.path))
        return cell

    def _warm(self, cell: Cell) -> Any:
        assert cell.proven is not None
        art = self.settings.art
        return _xla.proven_program(
            cell.proven,
            cell.compiled,
            self.params_dev,
            len(art.inputs),
            art.x64,
            cell.size,
            cell.example,
            self.settings.zero_copy,
        )

    def _checked(self, cell: Cell) -> Any:
        """A cold cell's program, its fast path checked against the public one. A stored
        executable that fails to run is compiled again."""
        art = self.settings.art

        def make() -> Any:
            return _xla.make_program(
                cell.compiled,
                self.params_dev,
                len(art.inputs),
                art.x64,
                cell.size,
                cell.example,
                fast_path=self.settings.fast_path,
                zero_copy=self.settings.zero_copy,
                proven=cell.proven,
            )

        try:
            return make()
        except Exception:
            if cell.source != "stored":
                raise
        self._recompile(cell)
        return make()

    def _recompile(self, cell: Cell) -> None:
        """A stored executable that loaded but does not run: compile the cell afresh and
        store that instead."""
        cache_dir = self.settings.cache_dir
        exe_key = self.key(cell, "executable")
        stored.discard_executable(cache_dir, exe_key)
        cell.compiled, cell.source = obtain(
            cache_dir,
            exe_key,
            self.devices,
            lambda afresh: self.compile_cell(cell.size, cell.lengths, afresh),
            fresh=True,
        )


def obtain(
    cache_dir: str | None,
    key: str,
    devices: list,
    compile: Callable[[bool], tuple[Any, str]],
    *,
    store: bool = True,
    fresh: bool = False,
) -> tuple[Any, str]:
    """One executable, as every loader gets it: (executable, where it came from:
    "stored", "cache" or "compiled"). The one stored under ``key`` when there is one
    that loads here; else ``compile(afresh)``, afresh (not from jax's persistent cache,
    whose executables cannot be stored) and then stored, unless jax cannot serialize
    this program (then through that cache). ``store=False``: neither read nor written
    (a multi-host group's processes compile alike); ``fresh``: compiled afresh whatever
    is stored (a stored one that did not run)."""
    if fresh or not store:
        compiled, refused = None, fresh
    else:
        compiled, refused = stored.load_executable(cache_dir, key, devices)
    if compiled is not None:
        return compiled, "stored"
    afresh = store and (refused or not stored.unstorable(cache_dir, key))
    compiled, source = compile(afresh)
    if afresh and source == "compiled":
        stored.store_executable(cache_dir, key, compiled)
    return compiled, source


class Cell:
    """One cell of one instance on its way to a ``Bucket``: what ``load``'s pool
    prepared."""

    def __init__(self, size: int, lengths: tuple[int, ...]) -> None:
        self.size = size
        self.lengths = tuple(lengths)
        self.compiled: Any = None
        #: "stored" (a stored executable), "cache" (jax's persistent cache) or "compiled"
        self.source = "stored"
        self.obtain_s = 0.0  # seconds to get the executable
        self.example: list[np.ndarray] = []  # full (size, ...) inputs, one per input
        self.proven: str | None = None  # the path an earlier load proved
        self.exec_s: float | None = None
        self.program: Any = None


def grid(
    art: artifact.Artifact,
    buckets: Sequence[Any] | None,
    dim_buckets: Mapping[str, Sequence[int]] | None,
    n_dev: int,
) -> list[tuple[int, tuple[int, ...]]]:
    """The cells to compile: (batch size rounded up to the devices, lengths)."""
    names = tuple(art.dim_buckets)
    dims = dict(art.dim_buckets)
    if dim_buckets is not None:
        unknown = set(dim_buckets) - set(names)
        if unknown:
            raise ValueError(
                f"dim_buckets names {sorted(unknown)}; {art.name!r} has named dimensions "
                f"{list(names) or 'none'}"
            )
        for d, lengths in dim_buckets.items():
            dims[d] = artifact.check_lengths(d, lengths)
    cells: set[tuple[int, tuple[int, ...]]] = set()
    if buckets is not None and any(isinstance(b, (tuple, list)) for b in buckets):
        for cell in buckets:
            if (
                not isinstance(cell, (tuple, list))
                or len(cell) != 1 + len(names)
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in cell)
            ):
                raise ValueError(
                    f"buckets: a cell is (batch, {', '.join(names) or '...'}) of positive ints, "
                    f"got {cell!r}"
                )
            size = artifact._check_buckets([cell[0]], None)[0]
            cells.add((-(-size // n_dev) * n_dev, tuple(cell[1:])))
    else:
        sizes = artifact._check_buckets(buckets if buckets is not None else art.batch_buckets, None)
        for size in sizes:
            for lengths in itertools.product(*(dims[d] for d in names)):
                cells.add((-(-size // n_dev) * n_dev, tuple(lengths)))
    for i, d in enumerate(names):
        shapes.check_lengths(repr(art.name), d, sorted({c[1][i] for c in cells}), art.bounds)
    if art.programs is not None:
        missing = sorted(c for c in cells if (c[0], *c[1]) not in art.programs)
        if missing:
            raise ValueError(
                f"{art.name!r} was exported with shapes='concrete': it runs the cells "
                f"{sorted(art.programs)} (batch, {', '.join(names) or '...'}) and no other, "
                f"not {[(c[0], *c[1]) for c in missing]}"
                + (
                    f" (batch sizes are rounded up to a multiple of the {n_dev} devices)"
                    if n_dev > 1
                    else ""
                )  # fmt: skip
            )
    return sorted(cells, key=lambda c: (lane_key(c[1]), c[0]))


SOURCE_WORDS = {
    "compiled": "compiled",
    "cache": "from jax's persistent cache",
    "stored": "stored executables",
}


def load_summary(
    load_s: float, phases: dict[str, float], sources: dict[str, int], what: str
) -> str:
    """One line on where a load went (for logs): its phases and where each of its
    programs (``what``: "cells", "programs") came from."""
    got = ", ".join(f"{n} {SOURCE_WORDS[s]}" for s, n in sorted(sources.items()))
    spent = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
    return f"loaded in {load_s:.2f} s ({spent}; {what}: {got})"


def progress_bar(total: int, desc: str, unit: str, progress: bool | None) -> Any:
    """A load's progress bar (``progress``: shown, hidden, or None: when stderr is a
    terminal); it disappears when done."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        disable=False if progress else (None if progress is None else True),
        leave=False,
    )


def check_memory(
    art: artifact.Artifact,
    cells: Sequence[tuple[int, tuple[int, ...]]],
    devices: list,
    staging_depth: int,
    instances: int = 1,
) -> None:
    """Refuse a load, before anything is placed or compiled, whose resident memory would
    not fit: params on every device and each cell's staging slots (inputs and outputs,
    ``staging_depth`` of each, per instance) against the host's available memory, and
    per device against what its backend reports free (CPU devices live in host
    memory)."""
    dims = tuple(art.dim_buckets)
    params = sum(int(a.nbytes) for a in jax.tree.leaves(art.params))
    staging = 0
    for size, lengths in cells:
        at = dict(zip(dims, lengths))
        per_row = sum(s.nbytes_at(at) for s in art.inputs.values())
        per_row += sum(s.nbytes_at(at) for s in art.outputs.values())
        staging += staging_depth * size * per_row * instances
    on_host = [d for d in devices if d.platform == "cpu"]
    need = params * (1 + len(on_host)) + staging * (2 if on_host else 1)
    advice = "load fewer or smaller buckets=..., dim_buckets=..., or a smaller staging_depth"
    free = available_host_bytes()
    if free is not None and need > free:
        where = f"on the host and each of {len(on_host)} CPU devices" if on_host else "on the host"
        raise ValueError(
            f"{art.name!r} needs about {_gib(need)} of host memory (params {_gib(params)} "
            f"{where}; staging {_gib(staging)} for {len(cells)} cells x {staging_depth} "
            f"slots{f' x {instances} instances' if instances > 1 else ''}) and "
            f"{_gib(free)} is available: {advice}"
        )
    per_device = params + staging // max(1, len(devices))
    for d in devices:
        left = device_free_bytes(d)
        if left is not None and per_device > left:
            raise ValueError(
                f"{art.name!r} needs about {_gib(per_device)} on {d} (params {_gib(params)} "
                f"and its share of the staging) and {_gib(left)} is free there: {advice}"
            )


def device_free_bytes(device: Any) -> int | None:
    """What an accelerator reports free (its limit less what is in use); None for a CPU
    device (its memory is the host's: ``available_host_bytes``) or a backend that does
    not say."""
    if device.platform == "cpu":
        return None
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend that does not report memory
        return None
    limit = stats.get("bytes_limit")
    return limit - stats.get("bytes_in_use", 0) if limit else None


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def available_host_bytes() -> int | None:
    """The host memory available to a new allocation (Linux's MemAvailable), or None
    where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# Staging for the largest bucket, per slot: beyond this a bucket is a mistake.
MAX_STAGING_BYTES = 16 << 30


def default_cache_dir() -> str:
    """Where ``pxrt.load`` keeps jax's compilation cache by default."""
    if os.environ.get("PXRT_CACHE_DIR"):
        return os.environ["PXRT_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pxrt", "xla")


def cache_dir(choice: bool | str | os.PathLike) -> str | None:
    """The compilation cache directory to use, or None (with a warning saying why): its
    files are native code that will run, so nobody else may be able to write there
    (``stored.safe_cache_dir`` says what is checked)."""
    if choice is False or choice is None:
        return None
    path = default_cache_dir() if choice is True else os.fspath(choice)
    try:
        return stored.safe_cache_dir(path)
    except OSError as exc:
        warnings.warn(f"pxrt: not caching compilations: {exc}", RuntimeWarning, 2)
        return None
