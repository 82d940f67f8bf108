"""Loading a decoder artifact (``pxrt.load`` calls ``load_decoder`` for one): the
programs built around the user's two exported functions (``DecoderPrograms``: the empty
state, the decode step with sampling fused in, a prefill-and-insert per prefill cell),
each obtained once (``pxrt.compiling.obtain``: stored, or compiled and stored), warmed
up, and handed to a ``pxrt.generate.Decoder`` (or, in a multi-host group's followers, to
a ``pxrt.multihost.Follower``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import _xla, compiling, sampling, shapes, stored
from .artifact import BATCH_AXIS
from .decoder import LENGTH_DIM, is_spec, sizes
from .decoder import read as read_decoder
from .generate import Decoder, PrefillCell, int_in
from .sampling import sample

log = logging.getLogger("pxrt")


def load_decoder(
    path: str | os.PathLike,
    *,
    devices: Sequence | None = None,
    slots: int | None = None,
    max_length: int | None = None,
    prefill_lengths: Sequence[int] | None = None,
    prefill_batches: Sequence[int] | None = None,
    max_waiting: int = 1024,
    progress: bool | None = None,
    compilation_cache: bool | str | os.PathLike = True,
    distributed: Any = None,
) -> Any:
    """Load a decoder artifact (``pxrt.load`` calls this for one): the step and every
    prefill cell compiled, the params and the cache on the devices.

    ``slots`` (rounded up to a multiple of the device count: the cache is sharded over
    the devices by slot), ``max_length``, ``prefill_lengths`` and ``prefill_batches``
    default to the artifact's. ``max_waiting`` bounds the prompts waiting for a slot.

    ``distributed`` (a ``pxrt.multihost.Distributed``): one process of a multi-host
    group, the cache sharded over every process's devices; process 0 gets the
    ``Decoder`` (every program it runs, the followers run too, in the same order), the
    others a ``pxrt.multihost.Follower`` (``docs/multihost.md``).
    """
    t0 = time.perf_counter()
    if distributed is not None:
        from . import multihost

        if devices is not None:
            raise ValueError("distributed: a multi-host load uses every process's devices")
        multihost.initialize(distributed)
        devices = jax.devices()
    art = read_decoder(path)
    devices = list(devices) if devices is not None else jax.local_devices()
    if not devices:
        raise ValueError("no devices to load on")
    slots, max_length, lengths, batches = _sizes(
        art.config, art.bounds, len(devices), slots, max_length, prefill_lengths, prefill_batches
    )
    max_waiting = int_in("max_waiting", max_waiting, 1, None)
    phases = {"read": time.perf_counter() - t0}

    _xla.compile_counter.ensure_registered()
    cache_dir = compiling.cache_dir(compilation_cache)
    in_group = distributed is not None
    with _xla.x64_scope(art.x64), _xla.persistent_cache(cache_dir):
        programs = DecoderPrograms(art, devices, slots, max_length, in_group=in_group)
        params_dev = programs.place(art.params)
        jobs = programs.jobs(lengths, batches)
        tp = time.perf_counter()
        got = _obtain_all(programs, jobs, cache_dir, progress, store=not in_group)
        tw = time.perf_counter()
        try:
            got.warm_up(params_dev, slots)
        except Exception:
            if not got.sources.get("stored"):
                raise
            # A stored executable that does not run: every program compiled afresh.
            got = _obtain_all(programs, jobs, cache_dir, progress, store=True, fresh=True)
            tw = time.perf_counter()
            got.warm_up(params_dev, slots)
        state = got.make_state()
        # Where the time went: tracing and compiling (or loading) the programs, then
        # one run of each.
        phases |= {"programs": tw - tp, "warm-up": time.perf_counter() - tw}
    if distributed is not None:
        fp = multihost.fingerprint(
            art.manifest, [list(job) for job in jobs] + [[slots, max_length]], len(devices)
        )
        if not distributed.leader:
            holder = _FollowerState(params_dev, state, art.x64)
            followed: list[Any] = [
                _FollowerProgram(holder, c.compiled, c.batch, c.length) for c in got.cells
            ]
            followed += [
                _FollowerProgram(holder, got.step, 0, 0),
                _FollowerProgram(holder, got.make_state, -1, 0),
            ]
            return multihost.Follower(distributed, art.name, followed, fp, time.perf_counter() - t0)
        group = multihost.Group(distributed)
        try:
            group.accept(fp)
        except BaseException:
            group.close()
            raise
    decoder = Decoder(
        art,
        devices,
        params_dev,
        state,
        got.step,
        got.cells,
        got.make_state,
        slots=slots,
        max_length=max_length,
        max_waiting=max_waiting,
        step_compile_s=got.step_s,
        load_s=time.perf_counter() - t0,
    )
    #: Where each program came from: "compiled", "cache" (jax's persistent cache) or
    #: "stored" (pxrt's stored executables) -> how many.
    decoder.program_sources = dict(got.sources)
    decoder.load_phases = {k: round(v, 4) for k, v in phases.items()}
    if distributed is not None:
        decoder.group = group
        decoder._gather = multihost.RowGather(
            group, multihost.Layout.of(programs.by_slot, slots, jax.process_index())
        )
    log.info("pxrt: %s version %s %s", art.name, decoder.version, decoder.load_summary())
    return decoder


def _sizes(
    config: dict,
    bounds: dict[str, int],
    n_dev: int,
    slots: int | None,
    max_length: int | None,
    prefill_lengths: Sequence[int] | None,
    prefill_batches: Sequence[int] | None,
) -> tuple[int, int, list[int], list[int]]:
    """The load's (slots, max_length, prefill lengths, prefill batches): given, else the
    artifact's; slots rounded up to a multiple of the devices."""

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    slots = sizes("slots", [given(slots, config["slots"])])[0]
    slots = -(-slots // n_dev) * n_dev
    max_length = sizes("max_length", [given(max_length, config["max_length"])])[0]
    lengths = sizes("prefill_lengths", given(prefill_lengths, config["prefill_lengths"]))
    batches = sizes("prefill_batches", given(prefill_batches, config["prefill_batches"]))
    if lengths[-1] >= max_length:
        raise ValueError(
            f"prefill_lengths go up to {lengths[-1]} but max_length is {max_length}: a prompt "
            "needs room for at least one generated token"
        )
    shapes.check_lengths("max_length", LENGTH_DIM, [max_length], bounds)
    shapes.check_lengths("prefill_lengths", "seq", lengths, bounds)
    if "num_devices" in config:  # concrete shapes: what was traced, and no other
        fixed = {
            "slots": (slots, config["slots"]),
            "max_length": (max_length, config["max_length"]),
        }
        fixed["devices"] = (n_dev, config["num_devices"])
        for what, (got, want) in fixed.items():
            if got != want:
                raise ValueError(
                    f"this decoder was exported with shapes='concrete' for {want} {what}, "
                    f"not {got}: load it as exported, or export it again"
                )
        for field, chosen in (("prefill_lengths", lengths), ("prefill_batches", batches)):
            untraced = sorted(set(chosen) - set(config[field]))
            if untraced:
                raise ValueError(
                    f"this decoder was exported with shapes='concrete' for {field} "
                    f"{config[field]}; {untraced} were not traced"
                )
    return slots, max_length, list(lengths), list(batches)


class DecoderPrograms:
    """The programs pxrt builds around a decoder artifact's prefill and decode, for
    ``slots`` cache slots of ``max_length`` tokens on ``devices`` (made inside the
    artifact's x64 scope):

    - ``make_state() -> state``: the empty state (the cache, and each slot's next token,
      position and sampling parameters);
    - ``step(params, state) -> (state, tokens)``: one decode step for every slot, with
      sampling fused in; the state is donated, so the cache is updated in place;
    - ``prefill_insert[b, L](params, state, tokens, ints, floats) -> (state, first)``:
      prefill ``b`` prompts of up to ``L`` tokens, sample each one's first token and
      write the rows, the token and the sampling parameters into the given slots.

    ``in_group``: in a multi-host group the step's tokens stay sharded by slot (each
    follower sends the leader its slots'); in one process they are on every device.
    """

    def __init__(
        self, art: Any, devices: list, slots: int, max_length: int, *, in_group: bool
    ) -> None:
        self.art, self.devices = art, devices
        self.slots, self.max_length = slots, max_length
        mesh = Mesh(np.array(devices), (BATCH_AXIS,))
        self.replicated = NamedSharding(mesh, P())
        self.by_slot = NamedSharding(mesh, P(BATCH_AXIS))
        self._specs = jax.tree.leaves(art.cache, is_leaf=is_spec)
        self._cache_tree = jax.tree.structure(art.cache, is_leaf=is_spec)
        self._length_axes = [
            s.shape.index(LENGTH_DIM) + 1 if LENGTH_DIM in s.shape else None for s in self._specs
        ]
        self.shapes = self._state_specs()
        state_sharding = jax.tree.map(lambda s: s.sharding, self.shapes)
        self.param_specs = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.replicated), art.params
        )
        self._state_jit = jax.jit(self._make_state, out_shardings=state_sharding)
        # Slots are independent: each device steps its own (shard_map), with no
        # collective; partitioned by jax instead, the step gathers the cache between
        # devices (21 all-gathers in the demo decoder's), which in a multi-host group
        # cross processes (milliseconds a step over gloo on CPU: docs/multihost.md).
        by_slot_specs = jax.tree.map(lambda _: P(BATCH_AXIS), self.shapes)
        local_step = jax.shard_map(
            self._step,
            mesh=mesh,
            in_specs=(P(), by_slot_specs),
            out_specs=(by_slot_specs, P(BATCH_AXIS)),
            check_vma=False,
        )
        self._step_jit = jax.jit(
            local_step,
            donate_argnums=(1,),
            out_shardings=(state_sharding, self.by_slot if in_group else self.replicated),
        )
        self._prefill_jit = jax.jit(
            self._prefill_insert,
            donate_argnums=(1,),
            out_shardings=(state_sharding, self.replicated),
        )

    def place(self, params: Any) -> Any:
        """``params`` on every device."""
        return jax.device_put(params, jax.tree.map(lambda _: self.replicated, params))

    @staticmethod
    def jobs(lengths: Sequence[int], batches: Sequence[int]) -> list[tuple[str, int, int]]:
        """Every program of a load, in order: (what, batch, length)."""
        todo = [("state", 0, 0), ("step", 0, 0)]
        return todo + [("prefill", b, n) for n in lengths for b in batches]

    def lower(self, what: str, b: int, n: int) -> Any:
        if what == "state":
            return self._state_jit.lower()
        if what == "step":
            return self._step_jit.lower(self.param_specs, self.shapes)
        args = (
            jax.ShapeDtypeStruct((b, n), jnp.int32, sharding=self.replicated),
            jax.ShapeDtypeStruct((b, 4), jnp.int32, sharding=self.replicated),
            jax.ShapeDtypeStruct((b, 2), jnp.float32, sharding=self.replicated),
        )
        return self._prefill_jit.lower(self.param_specs, self.shapes, *args)

    def key(self, what: str, b: int, n: int) -> str:
        """The stored key of one program: the artifact's files, the program and its
        sizes, the devices, and this code, from which the programs are traced."""
        return stored.key_of(
            {
                "decoder": self.art.manifest.get("files", {}),
                "program": [what, b, n, self.slots, self.max_length],
                "devices": stored.device_fields(self.devices),
                "x64": self.art.x64,
            },
            code=(sys.modules[__name__], sampling),
        )

    def describe(self, what: str, b: int, n: int) -> str:
        return {"state": "the empty state", "step": "the decode step"}.get(
            what, f"prefill {b} x {n}"
        )

    # The traced programs.

    def _state_specs(self) -> dict:
        cache = jax.tree.unflatten(
            self._cache_tree,
            [
                jax.ShapeDtypeStruct(
                    (self.slots,) + s.at({LENGTH_DIM: self.max_length}),
                    s.dtype,
                    sharding=self.by_slot,
                )
                for s in self._specs
            ],
        )
        # Per slot: int32 (next input token, its position, top-k, seed bits) and float32
        # (temperature, top-p): two arrays, so that an insert is two small scatters.
        return {
            "cache": cache,
            "ints": jax.ShapeDtypeStruct((self.slots, 4), jnp.int32, sharding=self.by_slot),
            "floats": jax.ShapeDtypeStruct((self.slots, 2), jnp.float32, sharding=self.by_slot),
        }

    def _make_state(self) -> dict:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.shapes)

    def _step(self, params: Any, state: dict) -> tuple[dict, jax.Array]:
        ints, floats = state["ints"], state["floats"]
        positions = jnp.minimum(ints[:, sampling.POS], self.max_length - 1)
        cache, logits = self.art.decode.call(
            params, state["cache"], ints[:, sampling.TOK], positions
        )
        following = positions + 1
        top_k = ints[:, sampling.TOPK]
        seed = lax.bitcast_convert_type(ints[:, sampling.SEED], jnp.uint32)
        temperature, top_p = floats[:, sampling.TEMP], floats[:, sampling.TOPP]
        tokens = sample(logits, temperature, top_k, top_p, seed, following)
        ints = jnp.stack([tokens, following, top_k, ints[:, sampling.SEED]], axis=1)
        return {"cache": cache, "ints": ints, "floats": floats}, tokens

    def _prefill_insert(
        self, params: Any, state: dict, tokens: jax.Array, ints: jax.Array, floats: jax.Array
    ) -> tuple[dict, jax.Array]:
        lengths, slot, top_k = ints[:, sampling.LEN], ints[:, sampling.SLOT], ints[:, sampling.TOPK]
        seed = lax.bitcast_convert_type(ints[:, sampling.SEED], jnp.uint32)
        temperature, top_p = floats[:, sampling.TEMP], floats[:, sampling.TOPP]
        rows, logits = self.art.prefill_for(*tokens.shape).call(params, tokens, lengths)
        first = sample(logits, temperature, top_k, top_p, seed, lengths)
        n = tokens.shape[1]
        cache = jax.tree.unflatten(
            self._cache_tree,
            [
                c.at[
                    (slot,)
                    if axis is None
                    else (slot,) + (slice(None),) * (axis - 1) + (slice(0, n),)
                ].set(r, mode="drop")
                for c, r, axis in zip(
                    jax.tree.leaves(state["cache"]), jax.tree.leaves(rows), self._length_axes
                )
            ],
        )
        rows_ints = jnp.stack([first, lengths, top_k, ints[:, sampling.SEED]], axis=1)
        return {
            "cache": cache,
            "ints": state["ints"].at[slot].set(rows_ints, mode="drop"),
            "floats": state["floats"].at[slot].set(floats, mode="drop"),
        }, first


@dataclasses.dataclass
class _Obtained:
    """A load's compiled programs: the empty state, the step, the prefill cells."""

    make_state: Any
    step: Any
    step_s: float
    cells: list[PrefillCell]
    sources: collections.Counter

    def warm_up(self, params: Any, slots: int) -> None:
        """One run of each program (on the zero state: no slot is busy) so that the
        first request does not pay for first-run work."""
        state = self.make_state()
        for cell in self.cells:
            ints = np.zeros((cell.batch, 4), np.int32)
            ints[:, sampling.LEN] = 1
            ints[:, sampling.SLOT] = slots  # out of range: the row is dropped
            floats = np.ones((cell.batch, 2), np.float32)
            tokens = np.zeros((cell.batch, cell.length), np.int32)
            state, first = cell.compiled(params, state, tokens, ints, floats)
        state, first = self.step(params, state)
        np.asarray(first.addressable_data(0))  # (the group's: a shard)


def _obtain_all(
    programs: DecoderPrograms,
    jobs: list[tuple[str, int, int]],
    cache_dir: str | None,
    progress: bool | None,
    *,
    store: bool,
    fresh: bool = False,
) -> _Obtained:
    """Every program of ``jobs``, on a pool (XLA's compile releases the GIL), each by
    ``pxrt.compiling.obtain``."""
    art = programs.art
    bar = compiling.progress_bar(len(jobs), f"pxrt: compiling {art.name}", "program", progress)

    def one(job: tuple[str, int, int]) -> tuple[Any, float, str]:
        tc = time.perf_counter()

        def compile_it(afresh: bool) -> tuple[Any, str]:
            try:
                return _xla.compile_here(lambda: programs.lower(*job), art.x64, cache_dir, afresh)
            except Exception as exc:
                raise ValueError(
                    f"{art.name!r}: {programs.describe(*job)} does not compile: {exc}"
                ) from exc

        compiled, source = compiling.obtain(
            cache_dir, programs.key(*job), programs.devices, compile_it, store=store, fresh=fresh
        )
        bar.update()
        return compiled, time.perf_counter() - tc, source

    workers = max(1, min(os.cpu_count() or 1, len(jobs)))
    with bar, concurrent.futures.ThreadPoolExecutor(workers) as pool:
        got = list(pool.map(one, jobs))
    cells = [
        PrefillCell(b, n, compiled, compile_s, i)
        for i, ((_, b, n), (compiled, compile_s, _)) in enumerate(zip(jobs[2:], got[2:]))
    ]
    return _Obtained(
        got[0][0], got[1][0], got[1][1], cells, collections.Counter(s for _, _, s in got)
    )


class _FollowerState:
    """A multi-host follower's decoder: the params and the cache state (its shards)."""

    def __init__(self, params: Any, state: Any, x64: bool) -> None:
        self.params = params
        self.state = state
        self.x64 = x64


class _FollowerProgram:
    """A follower's part of one decoder program (``pxrt.multihost.Follower``): a
    prefill cell (``batch`` > 0: the leader sends its tokens, ints and floats), the
    step (0: no inputs) or the empty state (-1, after a failed step)."""

    def __init__(self, holder: _FollowerState, compiled: Any, batch: int, length: int) -> None:
        self.holder = holder
        self.compiled = compiled
        self.batch = batch
        self.specs = (
            (np.dtype(np.int32), (length,)),
            (np.dtype(np.int32), (4,)),
            (np.dtype(np.float32), (2,)),
        )
        self.payload_bytes = max(0, batch) * sum(math.prod(s) * d.itemsize for d, s in self.specs)

    def run(self, body: bytearray) -> list:
        from .multihost import local_rows, split_rows

        h = self.holder
        with _xla.x64_scope(h.x64):
            if self.batch > 0:
                inputs = split_rows(body, self.specs, self.batch)
                h.state, out = self.compiled(h.params, h.state, *inputs)
            elif self.batch == 0:  # the step: its slots' tokens go to the leader
                h.state, out = self.compiled(h.params, h.state)
                return local_rows(out)
            else:
                h.state = out = self.compiled()
        jax.block_until_ready(out)  # answered once done: the leader reads it then
        return []
