"""Load an artifact as precompiled, bucketed executables on a device mesh: ``pxrt.load``.

Every batch bucket is compiled here, once, on a 1-D ``data`` mesh over the chosen
devices, with the batch sharded over it and the params placed once, replicated, and
shared by every bucket. Each bucket's fast path is checked against jax's own
``Compiled.__call__`` before it serves. After ``load`` returns nothing compiles again.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import math
import os
import queue
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from . import _ext, _xla, artifact, stored
from .contracts import PLACEMENTS
from .dispatch import Bucket, Engine, StagingRing, lane_key, lane_table

log = logging.getLogger("pxrt")

_SOURCE_WORDS = {
    "compiled": "compiled",
    "cache": "from jax's persistent cache",
    "stored": "stored executables",
}


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
        #: Where ``load_s`` went, in seconds: read (the artifact and its hashes),
        #: placement (``placement="auto"``'s measurement, when it ran), params
        #: (placed on the devices), compile (the pool's wall time: compiling, fetching
        #: from jax's persistent cache or loading stored executables; cold cells' fast-path
        #: checks, warm cells' warm-up runs), time (cold cells' timing runs).
        self.load_phases: dict[str, float] = {}
        #: The device group of each instance (one: the model is sharded over them all).
        self.instances: list[list] = [list(devices)]
        #: "sharded" or "replicated", and why (``pxrt.load(placement=...)``).
        self.placement = "sharded"
        self.placement_reason = ""
        #: A multi-host load's ``pxrt.multihost.Group`` (its followers), else None.
        self.group: Any = None
        self._timing_key: Callable[[Bucket], str] | None = None
        self._cache_dir: str | None = None
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
        inst = f", instances={len(self.instances)}" if len(self.instances) > 1 else ""
        return (
            f"Model({self.name!r}, version={self.version!r}, buckets={self.buckets}{dims}, "
            f"devices={len(self.devices)}{inst})"
        )

    def load_summary(self) -> str:
        """One line on where this model's load went (for logs): the phases of
        ``load_phases`` and where each cell's executable came from."""
        sources = collections.Counter(b.source for b in self.engine.buckets)
        got = ", ".join(f"{n} {_SOURCE_WORDS[s]}" for s, n in sorted(sources.items()))
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in self.load_phases.items())
        each = f" for each of {len(self.instances)} instances" if len(self.instances) > 1 else ""
        return f"loaded in {self.load_s:.2f} s ({phases}; cells{each}: {got})"

    def check_alive(self) -> None:
        """Raise ``pxrt.multihost.GroupBroken`` if this model cannot run batches any more
        (a multi-host group whose follower went away)."""
        if self.group is not None:
            self.group.check()

    def close(self) -> None:
        """Release what outlives the model's objects: a multi-host group's followers are
        told to stop. Idempotent."""
        if self.group is not None:
            self.group.close()

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
    def stale_cells(self) -> list[Bucket]:
        """The buckets whose execution time an earlier load measured (``remeasure``)."""
        return [b for b in self.engine.buckets if b.timed == "stored"]

    def remeasure(self, idle: Callable[[], bool] = lambda: True, most: int | None = None) -> int:
        """Time again the buckets whose execution time came from an earlier load, as the
        cold load times them, and store the new times. Meant for a background thread
        while the model serves: before and after timing each bucket it asks ``idle()``
        and stops when that is False, dropping a time taken while work came (the caller
        tries again later). ``most``: buckets to time at most.
        Returns how many were timed. The serving loop's batcher does this on its own."""
        done = 0
        for b in self.stale_cells:
            if (most is not None and done >= most) or not idle():
                break
            example = _staged_example(self.inputs, b.size, dict(zip(self.dim_names, b.lengths)))
            exec_s = _xla.time_program(b.program, _xla.StagingSlot(example, b.program.row_slices))
            if not idle():  # work came meanwhile: the time is not the cell's alone
                break
            b.exec_s, b.timed = exec_s, "measured"
            if self._timing_key is not None:
                stored.write_entry(self._cache_dir, self._timing_key(b), {"exec_s": b.exec_s})
            done += 1
        return done

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
                "source": b.source,
                "exec_ms": round(b.exec_s * 1e3, 4),
                "fast_path": b.fast_path,
                "path": b.program.path,
                "rows_per_device": size // len(self.instances[0]),
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
            "load_phases": dict(self.load_phases),
            "placement": self.placement,
            "placement_reason": self.placement_reason,
            "instances": [[str(d) for d in group] for group in self.instances],
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


def _staged_example(
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
    placement: str | None = None,
    instances: int | None = None,
    devices_per_instance: int | None = None,
    distributed: Any = None,
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
      placement: how the model uses ``devices``. ``"sharded"``: one program with the
        batch split over all of them. ``"replicated"``: ``instances`` copies of the
        model, each on its own ``devices_per_instance`` devices (default: one per
        device), each running whole batches; a batch goes to the instance that will
        finish it first. ``"auto"`` (the default; ``$PXRT_PLACEMENT`` sets another):
        measures at load the one program against instances (one per device, and
        halving counts down to one; just ``instances`` when given), the same rows in
        flight on each, and keeps the fastest; the choice is stored with the
        executables, and ``placement_reason`` says why.
      instances, devices_per_instance: for ``"replicated"`` and ``"auto"``; either one
        gives the other.
      distributed: a ``pxrt.multihost.Distributed`` (coordinator, num_processes,
        process_id): load as one process of a multi-host group, the batch sharded over
        every process's devices. Process 0 gets the ``Model`` (its batches run in
        lockstep on the whole group); the others get a ``pxrt.multihost.Follower``,
        whose ``follow()`` runs them (``docs/multihost.md``).
    """
    if artifact.kind(artifact.read_manifest(os.fspath(path))) == "decoder":
        from .generate import load_decoder

        if placement is not None or instances or devices_per_instance:
            warnings.warn(
                f"pxrt: {path}: a decoder runs one program over its devices; "
                f"placement={placement!r}, instances and devices_per_instance are ignored",
                RuntimeWarning,
                stacklevel=2,
            )

        return load_decoder(
            path,
            devices=devices,
            progress=progress,
            compilation_cache=compilation_cache,
            distributed=distributed,
            **decoder_options,
        )
    if decoder_options:
        raise TypeError(
            f"load() got options {sorted(decoder_options)} that only decoder artifacts take"
        )
    if distributed is not None:
        from . import multihost

        if devices is not None or placement is not None or instances or devices_per_instance:
            raise ValueError(
                "distributed: a multi-host load runs one program over every process's "
                "devices; devices, placement, instances and devices_per_instance do not apply"
            )
        return multihost.load(
            path,
            distributed,
            buckets=buckets,
            dim_buckets=dim_buckets,
            progress=progress,
            compilation_cache=compilation_cache,
            staging_depth=staging_depth,
            max_routes=max_routes,
            compile_workers=compile_workers,
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
    cache_dir = _cache_dir(compilation_cache)
    _xla.compile_counter.ensure_registered()
    settings = _Settings(
        art, cache_dir, fast_path, zero_copy, staging_depth, compile_workers, progress
    )
    placement = placement or default_placement()
    groups = _groups(devices, placement, instances, devices_per_instance)
    reason = {
        "sharded": f"placement='sharded': one program over {len(devices)} device(s)",
        "replicated": f"placement='replicated': {len(groups)} instance(s) of "
        f"{len(groups[0])} device(s)",
    }.get(placement, "")
    phases = {"read": time.perf_counter() - t0}
    if placement == "auto":
        tp = time.perf_counter()
        groups, reason = _choose_placement(
            settings, devices, groups, buckets, dim_buckets, ladder=instances is None
        )
        phases["placement"] = time.perf_counter() - tp
    cells = _grid(art, buckets, dim_buckets, len(groups[0]))
    model = _load_on(settings, groups, cells, phases, max_routes, t0)
    # One program over every device given, or instances (all of them, or fewer when
    # ``auto`` found fewer faster).
    model.placement = "sharded" if groups == [devices] else "replicated"
    model.placement_reason = reason
    log.info("pxrt: %s version %s %s", art.name, model.version, model.load_summary())
    return model


@dataclasses.dataclass(frozen=True)
class _Settings:
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


def _choose_placement(
    settings: _Settings,
    devices: list,
    groups: list[list],
    buckets: Sequence[Any] | None,
    dim_buckets: Mapping[str, Sequence[int]] | None,
    ladder: bool,
) -> tuple[list[list], str]:
    """``placement="auto"``: one program sharded over ``devices``, or instances of the
    model (the first k of ``groups``: every count from all of them, halving down to one
    when ``ladder``, else all of them), whichever serves more rows per second with the
    same rows in flight (``_throughput``): two batches of the largest bucket (in the
    cheapest lane) on the one program, two batches of its k-th share (padded to a
    bucket) on each of k instances. Anything but the one program must win by
    ``PLACEMENT_MARGIN``, and more instances must beat fewer by it. Measured once per
    machine, program and devices, and stored. Returns the chosen groups and why."""
    if len(devices) == 1:
        return [list(devices)], "placement='auto': one device"
    art = settings.art
    per = len(groups[0])
    cells_sh = _grid(art, buckets, dim_buckets, len(devices))
    cells_rep = _grid(art, buckets, dim_buckets, per)
    lane = min((c[1] for c in cells_sh), key=lane_key)
    probe_sh = max(c for c in cells_sh if c[1] == lane)
    counts = [len(groups)]
    while ladder and counts[-1] > 1:
        counts.append(counts[-1] // 2)
    # A candidate: its name, its groups, the cell it runs, the rows of its batches.
    candidates = [("sharded", [list(devices)], probe_sh, probe_sh[0])]
    sizes = [c[0] for c in cells_rep if c[1] == lane]
    for k in counts:
        if k == 1 and per == len(devices):
            continue  # one instance of every device: the sharded program itself
        share = min(-(-probe_sh[0] // k), max(sizes))
        size = min(s for s in sizes if s >= share)
        candidates.append((f"{k}x{per}", groups[:k], (size, lane), share))
    if len(candidates) == 1:
        return [list(devices)], "placement='auto': one instance is all the devices allow"
    what = "placement:" + ",".join(f"{c[0]}@{c[3]}" for c in candidates) + f":{lane}"
    key = stored.key(art, devices, probe_sh[0], lane, what, settings.zero_copy)
    found = stored.read_entry(settings.cache_dir, key)
    how = "stored"
    rates: dict[str, float] = {}
    names = [c[0] for c in candidates]
    if found and found.get("candidates") == names and found.get("rows_s"):
        rates = found["rows_s"]  # (those that fitted)
    else:
        how = "measured"
        models = {}
        for name, place, cell, rows in candidates:
            try:
                models[name] = (
                    _load_on(settings, place, [cell], {}, 8, time.perf_counter()),
                    rows,
                )
            except ValueError as exc:  # it would not fit (check_memory): not a candidate
                log.info("pxrt: %s: placement='auto' skips %s: %s", art.name, name, exc)
        if not models:  # the load itself says why nothing fits
            return [list(devices)], "placement='auto': no candidate fits to measure"
        runs: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(2):  # alternated
            for name, (model, rows) in models.items():
                runs[name].append(_throughput(model, rows, PLACEMENT_PROBE_S))
        rates = {name: max(r) for name, r in runs.items()}
    # The one program is preferred, then fewer instances: each other choice must be
    # faster by the margin (instances cost a compile each and staging on each).
    choice = "sharded" if "sharded" in rates else next(iter(rates))
    for name, *_ in sorted(candidates[1:], key=lambda c: len(c[1])):
        if name in rates and rates[name] > PLACEMENT_MARGIN * rates[choice]:
            choice = name
    if how == "measured":
        stored.write_entry(
            settings.cache_dir, key, {"candidates": names, "rows_s": rates, "choice": choice}
        )
    groups_of = {c[0]: c[1] for c in candidates}
    at = dict(zip(art.dim_buckets, lane))

    def who(name: str) -> str:
        if name == "sharded":
            return f"one program over {len(devices)} devices"
        n = len(groups_of[name])
        return f"{n} instance{'s' if n > 1 else ''} of {per} device{'s' if per > 1 else ''}"

    figures = "; ".join(
        f"{who(n)} {rates[n]:,.0f} rows/s in batches of {rows}"
        + (f" (bucket {c[0]})" if c[0] != rows else "")
        for n, _, c, rows in candidates
        if n in rates
    )
    reason = f"placement='auto' chose {who(choice)}: {figures}{f' at {at}' if at else ''} ({how})"
    return groups_of[choice], reason


# Seconds each candidate runs for, twice, when ``placement="auto"`` measures them; how
# much faster a costlier candidate must be to be chosen: above the probe's spread from
# one load to the next (up to 9% on 2 shared cores).
PLACEMENT_PROBE_S = 0.25
PLACEMENT_MARGIN = 1.10


def default_placement() -> str:
    """The placement of a load that names none: ``$PXRT_PLACEMENT`` when set (a
    deployment that wants every model one way, or a test suite that wants it fixed),
    else ``"auto"``."""
    value = os.environ.get("PXRT_PLACEMENT") or "auto"
    if value not in PLACEMENTS:
        raise ValueError(f"PXRT_PLACEMENT must be one of {', '.join(PLACEMENTS)}, got {value!r}")
    return value


def _throughput(model: Model, rows: int, seconds: float) -> float:
    """Rows per second of ``model``'s (one) bucket, served as the serving loop serves
    it, in miniature: one thread admits one-row requests (validation), plans batches of
    ``rows`` (padded to the bucket) and answers them (splitting), while the engine's
    pipeline keeps two batches in flight per instance on its workers (assembly,
    execution, fetch), each on the instance that will finish it first. A closed loop:
    each answered request comes back at once."""
    engine = model.engine
    at = dict(zip(model.dim_names, engine.buckets[0].lengths))
    request = example_inputs(model.inputs, 1, 0, at)
    prepare = engine.prepare
    plan = engine.queue()
    done: queue.SimpleQueue = queue.SimpleQueue()
    most = 2 * engine.instances
    pipeline = engine.pipeline(done.put, workers=most)
    for _ in range(rows * most):
        plan.push(*prepare(request))
    inflight = answered = 0
    t0 = time.perf_counter()
    stop = t0 + seconds
    try:
        while True:
            while inflight < most and (batch := plan.take(rows, 0.0)) is not None:
                pipeline.submit(batch)
                inflight += 1
            if not inflight:
                break
            batch = done.get()
            inflight -= 1
            if batch.error is not None:
                raise batch.error
            n = plan.deliver(batch)
            if time.perf_counter() < stop:
                answered += n
                for _ in range(n):
                    plan.push(*prepare(request))
    finally:
        pipeline.close()
    return answered / seconds


def _groups(
    devices: list, placement: str, instances: int | None, per_instance: int | None
) -> list[list]:
    """The device group of each instance: all the devices for ``sharded``; for
    ``replicated`` (and as ``auto``'s replicated candidate), ``instances`` groups of
    ``per_instance`` devices (one each by default; either one gives the other)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    for name, value in (("instances", instances), ("devices_per_instance", per_instance)):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(f"{name} must be an int >= 1 (or None), got {value!r}")
    if placement == "sharded":
        if (instances or 1) > 1 or (per_instance is not None and per_instance != len(devices)):
            raise ValueError(
                "placement='sharded' runs one instance over all the devices; give "
                "placement='replicated' (or 'auto') for instances or devices_per_instance"
            )
        return [list(devices)]
    if per_instance is None:
        per_instance = max(1, len(devices) // instances) if instances else 1
    count = instances or max(1, len(devices) // per_instance)
    if count * per_instance > len(devices):
        raise ValueError(
            f"{count} instance(s) of {per_instance} device(s) need {count * per_instance} "
            f"devices; {len(devices)} given"
        )
    return [devices[i * per_instance : (i + 1) * per_instance] for i in range(count)]


def _load_on(
    settings: _Settings,
    groups: list[list],
    cells: list[tuple[int, tuple[int, ...]]],
    phases: dict[str, float],
    max_routes: int,
    t0: float,
) -> Model:
    """Compile ``cells`` for each device group (an instance each) and make the Model."""
    art = settings.art
    dim_names = tuple(art.dim_buckets)
    in_specs = list(art.inputs.values())
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
    all_devices = [d for g in groups for d in g]
    check_memory(art, cells, all_devices, settings.staging_depth, len(groups))
    with _xla.x64_scope(art.x64), _xla.persistent_cache(settings.cache_dir):
        tp = time.perf_counter()
        instances = [_Instance(settings, group) for group in groups]
        phases["params"] = time.perf_counter() - tp
        todo = [(cell, inst) for cell in cells for inst in instances]
        bar = progress_bar(
            len(todo),
            f"pxrt: compiling {art.name}"
            + (f" ({len(instances)} instances)" if len(instances) > 1 else ""),
            "bucket",
            settings.progress,
        )

        def prepare(job: tuple[tuple[int, tuple[int, ...]], _Instance]) -> _Cell:
            cell = job[1].prepare(*job[0], timed=job[1] is instances[0])
            bar.update()
            return cell

        tp = time.perf_counter()
        workers = max(1, min(settings.compile_workers or os.cpu_count() or 1, len(todo)))
        # The costliest cells first, so that the pool does not end on one of them alone.
        order = sorted(range(len(todo)), key=lambda i: -todo[i][0][0] * math.prod(todo[i][0][1]))
        with bar, concurrent.futures.ThreadPoolExecutor(workers) as pool:
            done = dict(zip(order, pool.map(prepare, [todo[i] for i in order])))
        phases["compile"] = time.perf_counter() - tp
        phases["time"] = 0.0
        first = instances[0]
        compiled_buckets: list[Bucket] = []
        # Cold cells are timed one at a time on this thread, with nothing else running
        # (on the first instance: the others run the same program on devices alike).
        for c in range(len(cells)):
            per_instance = [done[c * len(instances) + i] for i in range(len(instances))]
            cell = per_instance[0]
            program = cell.program
            key = first.key(cell, program.path)
            # A stored time is an earlier load's, unless this load timed it (the probe).
            fresh = cell.exec_s is None or key in settings.timed_here
            timed = "measured" if fresh else "stored"
            if cell.exec_s is None:  # measured once per machine, program and cell
                tt = time.perf_counter()
                cell.exec_s = _xla.time_program(
                    program, _xla.StagingSlot(cell.example, program.row_slices)
                )
                stored.write_entry(settings.cache_dir, key, {"exec_s": cell.exec_s})
                settings.timed_here.add(key)
                phases["time"] += time.perf_counter() - tt
            shapes = [s.at(dict(zip(dim_names, cell.lengths))) for s in in_specs]
            rings = tuple(
                StagingRing(
                    [s.dtype for s in in_specs],
                    shapes,
                    cell.size,
                    each.program.row_slices,
                    depth=settings.staging_depth,
                )
                for each in per_instance
            )
            compiled_buckets.append(
                Bucket(
                    cell.size,
                    program,
                    rings[0],
                    cell.compiled,
                    cell.obtain_s,
                    cell.exec_s,
                    cell.lengths,
                    cell.source,
                    timed,
                    tuple(each.program for each in per_instance),
                    rings,
                )
            )
    model = Model(
        art, all_devices, compiled_buckets, first.params_dev, time.perf_counter() - t0, max_routes
    )
    model.instances = [list(g) for g in groups]
    model.load_phases = {k: round(v, 4) for k, v in phases.items()}
    model._timing_key = lambda b: first.key(b, b.program.path)
    model._cache_dir = settings.cache_dir
    return model


class _Instance:
    """One device group of a load: its mesh, params and jitted program; compiles,
    checks and warms cells for it."""

    def __init__(self, settings: _Settings, devices: list) -> None:
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
        self.jitted = jax.jit(
            art.exported.call,
            in_shardings=(params_sh,) + (self.rows,) * len(art.inputs),
            out_shardings=(self.rows,) * len(art.outputs),
            keep_unused=True,
        )

    def key(self, cell: Any, what: str) -> str:
        """The stored key of ``what`` about ``cell`` (a ``_Cell`` or ``Bucket``) here."""
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
        try:
            return _xla.compile_here(
                lambda: self.jitted.lower(self.param_specs, *x_specs), art.x64, cache_dir, afresh
            )
        except Exception as exc:
            where = f" at {at}" if at else ""
            raise ValueError(f"{art.name!r}: bucket {size}{where} does not compile: {exc}") from exc

    def prepare(self, size: int, lengths: tuple[int, ...], timed: bool) -> _Cell:
        """One cell, on the pool's threads: its executable (stored, or compiled), and its
        program: proven before and warmed up (a warm cell), or checked against the
        public path (a cold one). ``timed``: read its stored time (the instance whose
        cells are timed). Lowering holds the GIL; XLA's compile, loading a stored
        executable and running one release it."""
        settings = self.settings
        art, cache_dir, fast_path = settings.art, settings.cache_dir, settings.fast_path
        tc = time.perf_counter()
        cell = _Cell(size, lengths)
        exe_key = self.key(cell, "executable")
        cell.compiled, refused = stored.load_executable(cache_dir, exe_key, self.devices)
        if cell.compiled is None:
            # Compiled afresh, to be stored (an executable fetched from jax's cache
            # cannot be), unless jax cannot serialize it: then through that cache.
            afresh = refused or not stored.unstorable(cache_dir, exe_key)
            cell.compiled, cell.source = self.compile_cell(size, cell.lengths, afresh)
            if afresh and cell.source == "compiled":
                stored.store_executable(cache_dir, exe_key, cell.compiled)
        cell.obtain_s = time.perf_counter() - tc
        cell.example = _staged_example(art.inputs, size, dict(zip(art.dim_buckets, lengths)))
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

    def _warm(self, cell: _Cell) -> Any:
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

    def _checked(self, cell: _Cell) -> Any:
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

    def _recompile(self, cell: _Cell) -> None:
        """A stored executable that loaded but does not run: compile the cell afresh and
        store that instead."""
        cache_dir = self.settings.cache_dir
        exe_key = self.key(cell, "executable")
        stored.discard_executable(cache_dir, exe_key)
        cell.compiled, cell.source = self.compile_cell(cell.size, cell.lengths, True)
        if cell.source == "compiled":
            stored.store_executable(cache_dir, exe_key, cell.compiled)


class _Cell:
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
            f"{art.name!r} needs about {_size(need)} of host memory (params {_size(params)} "
            f"{where}; staging {_size(staging)} for {len(cells)} cells x {staging_depth} "
            f"slots{f' x {instances} instances' if instances > 1 else ''}) and "
            f"{_size(free)} is available: {advice}"
        )
    per_device = params + staging // max(1, len(devices))
    for d in devices:
        if d.platform == "cpu":
            continue
        try:
            stats = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 - a backend that does not report memory
            continue
        limit = stats.get("bytes_limit")
        if not limit:
            continue
        left = limit - stats.get("bytes_in_use", 0)
        if per_device > left:
            raise ValueError(
                f"{art.name!r} needs about {_size(per_device)} on {d} (params {_size(params)} "
                f"and its share of the staging) and {_size(left)} is free there: {advice}"
            )


def _size(n: float) -> str:
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


def _cache_dir(choice: bool | str | os.PathLike) -> str | None:
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
