"""Load an artifact as precompiled, bucketed executables on a device mesh: ``pxrt.load``.

Every batch bucket is compiled here, once, on a 1-D ``data`` mesh over the chosen
devices, with the batch sharded over it and the params placed once, replicated, and
shared by every bucket. Each bucket's fast path is checked against jax's own
``Compiled.__call__`` before it serves. After ``load`` returns nothing compiles again.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from . import _ext, _xla, artifact
from .dispatch import Bucket, Engine, StagingRing, lane_key, lane_table


class Model:
    """A loaded model: every bucket compiled, params resident. Thread-safe.

    Create with ``pxrt.load``. ``run`` serves one request, ``run_batch`` many in as few
    executions as the buckets allow. Outputs are read-only numpy arrays that may be
    views of the device outputs; pass ``copy=True`` for owned, writeable arrays.
    """

    def __init__(
        self,
        art: artifact.Artifact,
        devices: list,
        buckets: list[Bucket],
        params_dev: Any,
        load_s: float,
        max_routes: int,
    ) -> None:
        self.artifact = art
        self.name: str = art.name
        self.version: str = art.manifest["version"]
        self.inputs: dict[str, artifact.TensorSpec] = dict(art.inputs)
        self.outputs: dict[str, artifact.TensorSpec] = dict(art.outputs)
        self.devices = devices
        self.params_dev = params_dev
        self.load_s = load_s
        #: XLA compiles on this model's request path (counted by ``_xla.compile_counter``).
        self.request_path_compiles = 0
        #: Named dimensions, in order (empty for fixed shapes).
        self.dim_names: tuple[str, ...] = tuple(art.dim_buckets)
        dim_lengths, lane_of = lane_table(sorted({b.lengths for b in buckets}, key=lane_key))
        input_handler = _ext.InputHandler(
            self.name,
            list(self.inputs),
            [s.dtype for s in self.inputs.values()],
            [s.shape for s in self.inputs.values()],
            max_routes,
            dim_lengths,
            lane_of,
            [s.pad for s in self.inputs.values()],
        )
        result_handler = _ext.ResultHandler(
            list(self.outputs),
            [s.dtype for s in self.outputs.values()],
            [s.shape for s in self.outputs.values()],
            self.dim_names,
        )
        #: The execution engine: what ``run``/``run_batch`` and the serving layer drive.
        self.engine = Engine(self.name, input_handler, result_handler, buckets, owner=self)
        #: Batch sizes compiled (in every lane, for a full grid).
        self.buckets: tuple[int, ...] = self.engine.sizes
        self.max_batch: int = self.engine.max_rows
        #: Named dimension -> the lengths compiled.
        self.dim_buckets: dict[str, tuple[int, ...]] = dict(zip(self.dim_names, dim_lengths))

    def __repr__(self) -> str:
        dims = "".join(f", {k}={v}" for k, v in self.dim_buckets.items())
        return (
            f"Model({self.name!r}, version={self.version!r}, buckets={self.buckets}{dims}, "
            f"devices={len(self.devices)})"
        )

    @property
    def cells(self) -> list[tuple[int, dict[str, int]]]:
        """Every compiled cell: (batch size, named dimension -> length)."""
        return [(b.size, dict(zip(self.dim_names, b.lengths))) for b in self.engine.buckets]

    # ------------------------------------------------------------------ serving

    def run(self, request: Mapping[str, Any], *, copy: bool = False) -> dict[str, np.ndarray]:
        """Run one request (input name -> array with a leading batch dimension of n >= 1
        rows, exact dtype) and return output name -> array of n rows.

        Inputs with named dimensions take any length from 1 to the largest compiled
        one (the same in every input that names it); outputs that carry a named
        dimension come back cut to the request's length.

        Raises TypeError or ValueError, naming the input, for a malformed request.
        """
        engine = self.engine
        arrays, rows = engine.prepare(request)
        with _xla.compile_counter.request_path(self):
            return engine.run_one(arrays, rows, copy)

    def run_batch(
        self,
        requests: Sequence[Mapping[str, Any]],
        *,
        copy: bool = False,
        return_exceptions: bool = False,
    ) -> list:
        """Run many requests in as few executions as the buckets allow.

        Requests are packed in order into batches of at most the largest bucket; a
        request larger than the room left is split across batches and its outputs joined
        back. Returns one output dict per request, in order.

        With ``return_exceptions=False`` a malformed request raises its error before
        anything runs. With ``return_exceptions=True`` its entry in the result is the
        error instead, and every other request still gets its answer; an execution that
        fails gives its error to the requests of that batch only.
        """
        if isinstance(requests, Mapping) or not isinstance(requests, Sequence):
            raise TypeError(
                "run_batch takes a sequence of requests (dicts of input name -> "
                f"array), got {type(requests).__name__}"
            )
        results: list[Any] = [None] * len(requests)
        prepare = self.engine.prepare
        owners: list[int] = []
        prepared: list[tuple] = []
        for i, request in enumerate(requests):
            try:
                prepared.append(prepare(request))
            except (TypeError, ValueError) as exc:
                if not return_exceptions:
                    raise
                results[i] = exc
                continue
            owners.append(i)
        if prepared:
            with _xla.compile_counter.request_path(self):
                outs = self.engine.run_all(prepared, copy, return_exceptions)
            for i, out in zip(owners, outs):
                results[i] = out
        return results

    # ------------------------------------------------------------------ introspection

    def bucket(self, size: int, **lengths: int) -> Bucket:
        """The compiled bucket of exactly ``size`` rows (at exactly ``lengths``, e.g.
        ``seq=64``, for named dimensions)."""
        want = tuple(lengths.get(d) for d in self.dim_names)
        if set(lengths) != set(self.dim_names):
            raise KeyError(f"model {self.name!r}: give a length for each of {self.dim_names}")
        for b in self.engine.buckets:
            if b.size == size and b.lengths == want:
                return b
        raise KeyError(
            f"model {self.name!r} has no bucket of {size} rows at {lengths or 'its shapes'}: "
            f"{self.cells}"
        )

    def size_for(self, rows: int) -> int:
        """The size of the bucket a batch of ``rows`` rows runs in (the smallest that
        holds it; in the cheapest lane for models with named dimensions). ``bucket``
        gives the bucket itself."""
        return self.engine.bucket_for(rows).size

    @property
    def compiles_after_load(self) -> int:
        """XLA compiles that happened while serving this model's requests (must be 0)."""
        return self.request_path_compiles

    def describe(self) -> dict:
        """The manifest plus, per bucket, compile time, path, and XLA's cost and memory
        analysis of the compiled executable."""
        per_bucket = []
        for b in self.engine.buckets:
            size = b.size
            entry: dict[str, Any] = {
                "bucket": size,
                "lengths": dict(zip(self.dim_names, b.lengths)),
                "compile_s": round(b.compile_s, 4),
                "exec_ms": round(b.exec_s * 1e3, 4),
                "fast_path": b.fast_path,
                "path": b.program.path,
                "rows_per_device": size // len(self.devices),
            }
            try:
                cost = b.compiled.cost_analysis() or {}
                if isinstance(cost, list):
                    cost = cost[0] if cost else {}
                entry["flops"] = float(cost.get("flops", 0.0))
                entry["bytes_accessed"] = float(cost.get("bytes accessed", 0.0))
            except Exception:  # noqa: BLE001 - cost analysis is optional per backend
                pass
            try:
                mem = b.compiled.memory_analysis()
                if mem is not None:
                    entry["memory"] = {
                        "argument_bytes": mem.argument_size_in_bytes,
                        "output_bytes": mem.output_size_in_bytes,
                        "temp_bytes": mem.temp_size_in_bytes,
                        "generated_code_bytes": mem.generated_code_size_in_bytes,
                    }
            except Exception:  # noqa: BLE001 - memory analysis is optional per backend
                pass
            per_bucket.append(entry)
        return {
            "manifest": self.artifact.manifest,
            "devices": [str(d) for d in self.devices],
            "load_s": round(self.load_s, 4),
            "extensions": _ext.using_extensions(),
            "buckets": per_bucket,
        }


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


def load(
    path: str | os.PathLike,
    *,
    devices: Sequence | None = None,
    buckets: Sequence[int] | Sequence[tuple[int, ...]] | None = None,
    dim_buckets: Mapping[str, Sequence[int]] | None = None,
    progress: bool | None = None,
    compilation_cache: bool | str | os.PathLike = True,
    fast_path: bool = True,
    zero_copy: bool = True,
    staging_depth: int = 3,
    max_routes: int = 256,
    compile_workers: int | None = None,
    **decoder_options: Any,
) -> Any:
    """Load an artifact directory and compile every bucket; returns a ``Model``, or for
    a decoder artifact (``pxrt.export_decoder``) a ``pxrt.generate.Decoder``, loaded by
    ``pxrt.generate.load_decoder`` with ``devices``, ``progress``,
    ``compilation_cache`` and ``decoder_options`` (``slots``, ``max_length``,
    ``prefill_lengths``, ``prefill_batches``, ``max_waiting``).

    A model with named dimensions is compiled on a grid: every batch bucket at every
    combination of the named dimensions' lengths (a cell each).

    Args:
      path: a directory written by ``pxrt.export``. Its hashes, format version and jax
        version are checked first.
      devices: the devices of the 1-D data mesh (default: all local devices). The batch
        is sharded over them; params are replicated on each.
      buckets: batch sizes to compile (default: the artifact's). Each is rounded up to a
        multiple of the device count so it splits evenly. For named dimensions, cells
        may be listed instead: ``(batch, length, ...)`` tuples, a length per named
        dimension in order, to compile part of the grid.
      dim_buckets: named dimension -> lengths to compile (default: the artifact's); the
        largest is the longest input served.
      progress: show a progress bar while compiling (default: when stderr is a terminal).
      compilation_cache: keep jax's persistent compilation cache (compiled native code)
        so a second load of the same program on this machine is faster: True uses a
        per-user directory (``$PXRT_CACHE_DIR``, else ``$XDG_CACHE_HOME/pxrt/xla`` or
        ``~/.cache/pxrt/xla``), a path uses that directory, False none. Never inside
        the artifact: only this host writes the native code it runs, and a directory
        that others can write to is not used.
      fast_path: allow the raw execution path (each bucket is still checked against
        ``Compiled.__call__`` and falls back to it if they differ).
      zero_copy: let device buffers alias the staging slots instead of copying them
        (a slot is refilled only after its batch's outputs were fetched).
      staging_depth: staging slots per bucket (batches of one bucket in flight at once).
      max_routes: bound of the request-signature route cache.
      compile_workers: threads compiling cells at once (default: one per CPU core; XLA's
        compile releases the GIL).
    """
    if artifact.kind(artifact.read_manifest(os.fspath(path))) == "decoder":
        from .generate import load_decoder

        return load_decoder(
            path,
            devices=devices,
            progress=progress,
            compilation_cache=compilation_cache,
            **decoder_options,
        )
    if decoder_options:
        raise TypeError(
            f"load() got options {sorted(decoder_options)} that only decoder artifacts take"
        )
    if compile_workers is not None and (
        not isinstance(compile_workers, int)
        or isinstance(compile_workers, bool)
        or compile_workers < 1
    ):
        raise ValueError(f"compile_workers must be an int >= 1 (or None), got {compile_workers!r}")
    t0 = time.perf_counter()
    art = artifact.read(path)
    devices = list(devices) if devices is not None else jax.local_devices()
    if not devices:
        raise ValueError("no devices to load on")
    n_dev = len(devices)
    cells = _grid(art, buckets, dim_buckets, n_dev)
    dim_names = tuple(art.dim_buckets)

    _xla.compile_counter.ensure_registered()
    mesh = Mesh(np.array(devices), (artifact.BATCH_AXIS,))
    replicated = NamedSharding(mesh, P())
    rows = NamedSharding(mesh, P(artifact.BATCH_AXIS))
    n_in = len(art.inputs)
    n_out = len(art.outputs)
    in_specs = list(art.inputs.values())
    cache_dir = _cache_dir(compilation_cache)
    for size, lengths in cells:
        at = dict(zip(dim_names, lengths))
        staging = size * sum(s.nbytes_at(at) for s in in_specs)
        if staging > MAX_STAGING_BYTES:
            where = f" at {at}" if at else ""
            raise ValueError(
                f"bucket {size}{where} of {art.name!r} needs {staging / 2**30:.1f} GiB of "
                f"staging per slot (over {MAX_STAGING_BYTES / 2**30:.0f} GiB); load it with "
                "smaller buckets=..."
            )

    compiled_buckets: list[Bucket] = []
    with _xla.x64_scope(art.x64), _xla.persistent_cache(cache_dir):
        params_sh = jax.tree.map(lambda _: replicated, art.params)
        params_dev = jax.device_put(art.params, params_sh)
        param_specs = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), art.params
        )
        jitted = jax.jit(
            art.exported.call,
            in_shardings=(params_sh,) + (rows,) * n_in,
            out_shardings=(rows,) * n_out,
            keep_unused=True,
        )
        bar = tqdm(
            total=len(cells),
            desc=f"pxrt: compiling {art.name}",
            unit="bucket",
            disable=False if progress else (None if progress is None else True),
            leave=False,
        )

        def compile_cell(cell: tuple[int, tuple[int, ...]]) -> tuple[Any, float]:
            # Lowering holds the GIL; XLA's compile releases it, so cells compile in
            # parallel on the pool's threads.
            size, lengths = cell
            tc = time.perf_counter()
            at = dict(zip(dim_names, lengths))
            x_specs = [
                jax.ShapeDtypeStruct((size,) + s.at(at), s.dtype, sharding=rows) for s in in_specs
            ]
            try:
                with _xla.x64_scope(art.x64), _xla.cache_settings(cache_dir):
                    compiled = jitted.lower(param_specs, *x_specs).compile()
            except Exception as exc:
                where = f" at {at}" if at else ""
                raise ValueError(
                    f"{art.name!r}: bucket {size}{where} does not compile: {exc}"
                ) from exc
            bar.update()
            return compiled, time.perf_counter() - tc

        workers = max(1, min(compile_workers or os.cpu_count() or 1, len(cells)))
        with bar, concurrent.futures.ThreadPoolExecutor(workers) as pool:
            compiled_cells = list(pool.map(compile_cell, cells))
        for (size, lengths), (compiled, compile_s) in zip(cells, compiled_cells):
            tc = time.perf_counter()
            at = dict(zip(dim_names, lengths))
            shapes = [s.at(at) for s in in_specs]
            example = [_xla.aligned_empty((size,) + sh, s.dtype) for sh, s in zip(shapes, in_specs)]
            values = example_inputs(art.inputs, size, seed=size, lengths=at).values()
            for buf, value in zip(example, values):
                buf[...] = value
            proof = _timing_key(art, devices, size, lengths, f"proof:{fast_path}", zero_copy)
            proven = _stored_path(cache_dir, proof)
            program = _xla.make_program(
                compiled,
                params_dev,
                n_in,
                art.x64,
                size,
                example,
                fast_path=fast_path,
                zero_copy=zero_copy,
                proven=proven,
            )
            if proven != program.path:
                _write_entry(cache_dir, proof, {"path": program.path})
            compile_s += time.perf_counter() - tc  # (and its check against the public path)
            ring = StagingRing(
                [s.dtype for s in in_specs],
                shapes,
                size,
                program.row_slices,
                depth=staging_depth,
            )
            key = _timing_key(art, devices, size, lengths, program.path, zero_copy)
            exec_s = _stored_time(cache_dir, key)
            if exec_s is None:  # measured once per machine, program and cell
                exec_s = _xla.time_program(program, _xla.StagingSlot(example, program.row_slices))
                _write_entry(cache_dir, key, {"exec_s": exec_s})
            compiled_buckets.append(
                Bucket(size, program, ring, compiled, compile_s, exec_s, tuple(lengths))
            )
    return Model(art, devices, compiled_buckets, params_dev, time.perf_counter() - t0, max_routes)


# --------------------------------------------------------------------------- stored timings
# A cell's execution time (what the serving policy's cell choice compares) and the path
# its fast-path check proved are found once per machine, program and cell, and kept
# beside the compiled executables: a warm load reads them instead of running the cell
# back to back and against the public path (it still runs it once, to warm it up). The
# key holds everything that could change them; an entry whose bytes do not check out
# is found again.

TIMINGS = "timings"


def _timing_key(
    art: artifact.Artifact,
    devices: list,
    size: int,
    lengths: tuple[int, ...],
    path: str,
    zero_copy: bool,
) -> str:
    import hashlib

    import jaxlib

    from . import __version__

    fields = {
        "program": art.manifest.get("files", {}).get(artifact.PROGRAM_FILE, ""),
        "params": art.manifest.get("files", {}).get(artifact.PARAMS_FILE, ""),
        "cell": [size, list(lengths)],
        "devices": [[d.platform, getattr(d, "device_kind", ""), d.id] for d in devices],
        "versions": [jax.__version__, jaxlib.__version__, __version__],
        "path": path,
        "zero_copy": zero_copy,
        "x64": art.x64,
        "flags": os.environ.get("XLA_FLAGS", ""),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _read_entry(cache_dir: str | None, key: str) -> dict | None:
    """What is stored under ``key`` (None: nothing, or an entry that does not check out:
    it is measured or proven again and rewritten)."""
    if cache_dir is None:
        return None
    try:
        with open(os.path.join(cache_dir, TIMINGS, key + ".json")) as f:
            doc = json.load(f)
        value = doc["value"]
        if doc["key"] != key or doc["check"] != _check(key, value):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, dict) else None


def _write_entry(cache_dir: str | None, key: str, value: dict) -> None:
    if cache_dir is None:
        return
    folder = os.path.join(cache_dir, TIMINGS)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        tmp = os.path.join(folder, f".{key}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump({"key": key, "value": value, "check": _check(key, value)}, f)
        os.replace(tmp, os.path.join(folder, key + ".json"))
    except OSError:
        pass  # measured again next time


def _check(key: str, value: dict) -> str:
    import hashlib

    return hashlib.sha256(f"{key}:{json.dumps(value, sort_keys=True)}".encode()).hexdigest()


def _stored_time(cache_dir: str | None, key: str) -> float | None:
    value = _read_entry(cache_dir, key)
    exec_s = None if value is None else value.get("exec_s")
    if not isinstance(exec_s, float) or not 0 < exec_s < 3600:
        return None
    return exec_s


def _stored_path(cache_dir: str | None, key: str) -> str | None:
    value = _read_entry(cache_dir, key)
    path = None if value is None else value.get("path")
    return path if path in ("call", "raw", "public") else None


def _grid(
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
    return sorted(cells, key=lambda c: (lane_key(c[1]), c[0]))


# Staging for the largest bucket, per slot: beyond this a bucket is a mistake.
MAX_STAGING_BYTES = 16 << 30


def default_cache_dir() -> str:
    """Where ``pxrt.load`` keeps jax's compilation cache by default."""
    if os.environ.get("PXRT_CACHE_DIR"):
        return os.environ["PXRT_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pxrt", "xla")


def _cache_dir(choice: bool | str | os.PathLike) -> str | None:
    """The compilation cache directory to use, or None: it must be a directory of this
    user's that nobody else can write to (its files are native code that will run)."""
    if choice is False or choice is None:
        return None
    path = default_cache_dir() if choice is True else os.fspath(choice)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as exc:
        warnings.warn(f"pxrt: not caching compilations: {path}: {exc}", RuntimeWarning, 2)
        return None
    if (hasattr(os, "getuid") and st.st_uid != os.getuid()) or st.st_mode & 0o022:
        warnings.warn(
            f"pxrt: not caching compilations in {path}: it belongs to another user or others "
            "can write to it",
            RuntimeWarning,
            2,
        )
        return None
    return path
