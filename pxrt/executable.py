"""Load an artifact as precompiled, bucketed executables on a device mesh: ``pxrt.load``.

Every batch bucket is compiled here, once, on a 1-D ``data`` mesh over the chosen
devices, with the batch sharded over it and the params placed once, replicated, and
shared by every bucket. Each bucket's fast path is checked against jax's own
``Compiled.__call__`` before it serves. After ``load`` returns nothing compiles again.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import os
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from . import _ext, _xla, artifact, compiling, stored
from .contracts import PLACEMENTS
from .dispatch import Bucket, Engine, StagingRing, lane_key, lane_table

log = logging.getLogger("pxrt")


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
        each = f" for each of {len(self.instances)} instances" if len(self.instances) > 1 else ""
        return compiling.load_summary(self.load_s, self.load_phases, sources, f"cells{each}")

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

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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
            at = dict(zip(self.dim_names, b.lengths))
            example = compiling.staged_example(self.inputs, b.size, at)
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


def load_model(
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
) -> Model:
    """Load a model artifact on this process's devices (``pxrt.load`` documents the
    arguments; it is the front door that sends model artifacts here)."""
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
    cache_dir = compiling.cache_dir(compilation_cache)
    _xla.compile_counter.ensure_registered()
    settings = compiling.Settings(
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
    cells = compiling.grid(art, buckets, dim_buckets, len(groups[0]))
    model = _load_on(settings, groups, cells, phases, max_routes, t0)
    # One program over every device given, or instances (all of them, or fewer when
    # ``auto`` found fewer faster).
    model.placement = "sharded" if groups == [devices] else "replicated"
    model.placement_reason = reason
    log.info("pxrt: %s version %s %s", art.name, model.version, model.load_summary())
    return model


def _choose_placement(
    settings: compiling.Settings,
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
    if art.programs is not None:  # its cells are what they are: no smaller instances
        return [list(devices)], "placement='auto': a concrete-shape artifact runs sharded"
    per = len(groups[0])
    cells_sh = compiling.grid(art, buckets, dim_buckets, len(devices))
    cells_rep = compiling.grid(art, buckets, dim_buckets, per)
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
    request = compiling.example_inputs(model.inputs, 1, 0, at)
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
    settings: compiling.Settings,
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
        if staging > compiling.MAX_STAGING_BYTES:
            where = f" at {at}" if at else ""
            raise ValueError(
                f"bucket {size}{where} of {art.name!r} needs {staging / 2**30:.1f} GiB of "
                f"staging per slot (over {compiling.MAX_STAGING_BYTES / 2**30:.0f} GiB); "
                "load it with smaller buckets=..."
            )
    all_devices = [d for g in groups for d in g]
    compiling.check_memory(art, cells, all_devices, settings.staging_depth, len(groups))
    with _xla.x64_scope(art.x64), _xla.persistent_cache(settings.cache_dir):
        tp = time.perf_counter()
        instances = [compiling.Instance(settings, group) for group in groups]
        phases["params"] = time.perf_counter() - tp
        todo = [(cell, inst) for cell in cells for inst in instances]
        bar = compiling.progress_bar(
            len(todo),
            f"pxrt: compiling {art.name}"
            + (f" ({len(instances)} instances)" if len(instances) > 1 else ""),
            "bucket",
            settings.progress,
        )

        def prepare(job: tuple[tuple[int, tuple[int, ...]], compiling.Instance]) -> compiling.Cell:
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
