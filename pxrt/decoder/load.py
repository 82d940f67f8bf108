"""Loading a decoder artifact (``pxrt.load`` calls ``load_decoder`` for one): the
programs built around the user's two exported functions (``DecoderPrograms``: the empty
state, the decode step with sampling fused in, a prefill-and-insert per prefill cell),
each obtained once (``pxrt.compiling.obtain``: stored, or compiled and stored), warmed
up, and handed to a ``pxrt.decoder.engine.Decoder`` (or, in a multi-host group's followers, to
a ``pxrt.multihost.Follower``).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import dataclasses
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Collection, Sequence
from typing import Any

import jax
import numpy as np

from .. import _xla, compiling, sampling, shapes
from . import grammar
from .engine import Decoder
from .export import CHUNK_DIM, LENGTH_DIM, is_spec, sizes
from .export import read as read_decoder
from .params import int_in, number_in
from .prefix import PoolBox, PrefixIndex, PrefixPool
from .programs import POOL, DecoderPrograms
from .relayout import tier_pairs
from .runner import (
    BlockStep,
    FullStep,
    Packed,
    PrefillCell,
    Saving,
    SplitPrefill,
    dropped_prefill,
)

#: The prefix cache's block (tokens) unless ``prefix_block`` says otherwise.
PREFIX_BLOCK = 16
#: The most decode steps one program runs unless ``multi_step`` says otherwise.
MULTI_STEP = 4
#: With ``length_tiers`` unset, a decoder on CPU devices with at least this many slots
#: sizes its length tiers from the traffic (``"auto"``): there the step is bound by
#: reading the cache, and tiers learned while serving made more tokens/s than the one
#: cache with a lower ITL p99 at 16-64 slots (``benchmarks/scheduler.py --ab auto``);
#: at 8 slots one or two long slots held the long prompts' queue (TTFT p99 2.5x).
AUTO_TIERS = 16

log = logging.getLogger("pxrt")


def load_decoder(
    path: str | os.PathLike,
    *,
    devices: Sequence | None = None,
    slots: int | None = None,
    max_length: int | None = None,
    prefill_lengths: Sequence[int] | None = None,
    prefill_batches: Sequence[int] | None = None,
    chunk_lengths: Sequence[int] | None = None,
    chunk_batches: Sequence[int] | None = None,
    prefix_cache_tokens: int | None = None,
    prefix_block: int = PREFIX_BLOCK,
    chunk_tokens: int | None = None,
    step_slots: Sequence[int] | None = None,
    step_lengths: Sequence[int] | None = None,
    speculative_tokens: int = 0,
    sampling_controls: bool = True,
    max_waiting: int = 1024,
    itl_bound_ms: float | None = None,
    overlap_prefill: bool | None = None,
    multi_step: int | None = None,
    length_tiers: str | Sequence[tuple[int, int]] | None = None,
    defer: bool = True,
    progress: bool | None = None,
    compilation_cache: bool | str | os.PathLike = True,
    distributed: Any = None,
) -> Any:
    """Load a decoder artifact (``pxrt.load`` calls this for one): the step and every
    prefill cell compiled, the params and the cache on the devices.

    ``slots`` (rounded up to a multiple of the device count: the cache is sharded over
    the devices by slot), ``max_length``, ``prefill_lengths`` and ``prefill_batches``
    (and, for a decoder with ``extend``, ``chunk_lengths`` and ``chunk_batches``)
    default to the artifact's; ``prefill_lengths`` with lengths between the artifact's
    from 32 up, so that a prompt pads by a quarter at most (``finer_lengths``; not for
    concrete shapes or in a multi-host group). ``max_waiting`` bounds the prompts
    waiting for a slot.
    ``step_slots``: the slot counts the decode step is also compiled for (default: a
    quarter and a half of ``slots``; ``()``: every step over all of them): the loop
    steps the fewest that hold the busy slots, which it keeps together, so a server at
    a quarter of its slots pays for a quarter of a step.
    ``step_lengths``: the cache windows the steps are also compiled for (default, for a
    ``max_length`` of 256 or more: a quarter and a half of it; ``()``: none): a step
    whose busy slots are all within the first ``n`` positions reads and attends over
    those only, so short sequences in a long cache pay for their own length.
    ``chunk_tokens``: prompt tokens prefilled in chunks per turn of the loop, between two
    decode steps (default: the largest chunk length): more shortens a long prompt's
    time to first token, and lengthens the running streams' gaps while it is prefilled.

    The prefix cache (decoders with ``extend``): ``prefix_cache_tokens`` prompt tokens'
    cache rows kept on the devices in blocks of ``prefix_block`` (default: half as many
    as the slots hold; 0: off), so a prompt that starts as an earlier one did
    prefills only the rest.

    ``defer`` (default True): the decoder is ready once the state, the step and a way
    in for every prompt are compiled (the 1-row extend cells: prompts go in chunks
    meanwhile; without extend, the smallest prefill cells); the others (the prefill
    cells, the steps over fewer slots or positions, larger cells, the sampling
    controls', the prefix cache's and speculation's programs) compile on a thread of
    their own after, and the loop takes them between two turns (``Decoder.deferred``,
    ``Decoder.wait_programs``). Until then a request that asks for logprobs or controls
    waits for them, prompts are not cached and nothing is speculated. False: every
    program before the load returns. A multi-host group compiles every program first.

    ``itl_bound_ms``: the time a turn of the loop may spend prefilling new prompts
    beside its decode step, so the running streams' inter-token gap stays near the bound:
    the scheduler prices each choice (which waiting prompts, at which prefill cell) with
    the programs' times measured at load (default: a full step plus the longest
    single-prompt prefill, so one prompt of any length is admitted per turn at least).

    ``overlap_prefill``: prefill new prompts on a thread of their own while the loop
    steps the running streams, and insert them into their slots once done (each
    prefill cell is then two programs); the streams' steps no longer wait for a
    prompt's prefill. Default: on where every device is a CPU (their programs run
    concurrently from two threads; an accelerator runs one program at a time), off in
    a multi-host group; and by default a prompt whose prefill fits the turn's bound
    goes beside the steps or between two of them as the tokens/s each way makes while
    serving say (``pxrt.decoder.placement``: on 2 cores a small model's prefill beside
    the steps takes more from them than it saves). True: beside, always.

    ``multi_step``: the most decode steps one program runs (default ``MULTI_STEP``, 4;
    1: one step per program; the program count is the same either way, the number of
    steps being an argument). While nothing waits on the turns between steps (a prompt
    for a free slot, a prefill to insert), the loop runs as many steps in one program as
    fit in 2 ms at the measured price of one launch and each step's device time
    (``pxrt.decoder.scheduler.BLOCK_S``; fewer
    when a generation's ``max_tokens`` comes first and prompts wait for its slot): the
    host's work per token shrinks by as much where steps are cheap, and each stream's
    tokens come in bursts no longer than that. One per program while a slot has sampling
    controls or logprobs, while speculating, and in a multi-host group.

    ``length_tiers`` (``"20x128+10x256+2x512"`` or ``[(20, 128), ...]``: slots x
    positions per tier): the cache as one array per tier, all stepped in one
    program, each at its own length, so a short sequence reads a short cache; a prompt
    goes to the smallest tier with a free slot that holds its prompt and ``max_tokens``.
    The slots are the tiers' sum and ``max_length`` the longest tier's; a prompt longer
    than the longest prefill is chunked into its tier's slot, and a cached start is
    copied there. Without (for now): steps over fewer slots or cache windows,
    speculation, a multi-host group. ``"auto"``: one cache until the traffic has sized
    the tiers (``Decoder.suggested_length_tiers``, the same for 32 samples in a row),
    then their programs compile on a thread of their own and the loop switches to them
    between two turns (``Decoder.set_length_tiers`` does it for tiers given), and again
    when the traffic needs other tiers. Unset: ``"auto"`` on CPU devices at
    ``AUTO_TIERS`` (16) slots or more, not with speculation or in a multi-host group;
    one cache otherwise. ``"off"``: one cache, never changed.

    ``sampling_controls`` False: requests may not ask for logprobs, ``logit_bias``,
    penalties or ``min_tokens`` (two programs fewer to compile: the full step and the
    controls' insert).

    ``speculative_tokens`` (decoders with ``extend``; default 0: off): when every busy
    slot decodes greedily, the loop drafts up to that many tokens per slot from its own
    text (prompt lookup: what followed the last occurrence of its last tokens) and
    verifies them all in one ``extend`` over the slots; the tokens are those greedy
    decoding gives, more of them per program on repetitive text.

    ``distributed`` (a ``pxrt.multihost.Distributed``): one process of a multi-host
    group, the cache sharded over every process's devices; process 0 gets the
    ``Decoder`` (every program it runs, the followers run too, in the same order), the
    others a ``pxrt.multihost.Follower`` (``docs/multihost.md``).
    """
    t0 = time.perf_counter()
    in_group = distributed is not None
    if in_group:
        from .. import multihost

        if devices is not None:
            raise ValueError("distributed: a multi-host load uses every process's devices")
        multihost.initialize(distributed)
        devices = jax.devices()
    art = read_decoder(path)
    devices = list(devices) if devices is not None else jax.local_devices()
    if not devices:
        raise ValueError("no devices to load on")
    plan = _plan(
        art, len(devices), in_group, slots=slots, max_length=max_length,
        prefill_lengths=prefill_lengths, prefill_batches=prefill_batches,
        chunk_lengths=chunk_lengths, chunk_batches=chunk_batches,
        prefix_cache_tokens=prefix_cache_tokens, prefix_block=prefix_block,
        step_slots=step_slots, step_lengths=step_lengths,
        speculative_tokens=speculative_tokens, max_waiting=max_waiting,
        sampling_controls=sampling_controls, chunk_tokens=chunk_tokens,
        itl_bound_ms=itl_bound_ms, overlap_prefill=overlap_prefill, devices=devices,
        multi_step=multi_step, length_tiers=length_tiers,
    )  # fmt: skip
    plan.phases = {"read": time.perf_counter() - t0}
    _xla.compile_counter.ensure_registered()
    cache_dir = compiling.cache_dir(compilation_cache)
    built = _build(art, devices, plan, cache_dir, progress, defer, in_group)
    if in_group and not distributed.leader:
        return _follower(distributed, art, devices, plan, built, t0)
    group = _join_group(distributed, art, devices, plan, built) if in_group else None
    decoder = _decoder(art, devices, plan, built, t0)
    if group is not None:
        decoder.group = group
        decoder._gather = multihost.RowGather(
            group, multihost.Layout.of(built.programs.by_slot, plan.slots, jax.process_index())
        )
    if not in_group and not plan.speculative_tokens:
        builder = _tier_builder(art, devices, plan, cache_dir, built.params)
        decoder._wire_relayout(builder, plan.auto_tiers)
    log.info("pxrt: %s version %s %s", art.name, decoder.version, decoder.load_summary())
    if built.later:
        _compile_later(
            decoder, built.programs, built.later, cache_dir, built.params,
            built.got.make_state, plan.between,
        )  # fmt: skip
    return decoder


@dataclasses.dataclass
class _Plan:
    """A load's sizes and options, checked: what ``load_decoder`` was given, else the
    artifact's."""

    slots: int
    max_length: int
    lengths: list[int]
    batches: list[int]
    chunks: list[int]
    chunk_rows: list[int]
    prefix: tuple[int, int] | None
    parts: list[int]
    windows: list[int]
    speculative_tokens: int
    max_waiting: int
    controls: bool
    chunk_tokens: int | None
    itl_bound_ms: float | None
    #: Prefill on a thread of its own (``overlap_prefill``).
    overlap: bool = False
    #: The most steps a decode program runs (``multi_step``).
    multi_step: int = 1
    #: The cache's length tiers (``length_tiers``): (slots, positions) each, or ().
    tiers: tuple[tuple[int, int], ...] = ()
    #: Tiers sized by the traffic, applied while serving (``length_tiers="auto"``).
    auto_tiers: bool = False
    #: The prefill lengths the load added between the artifact's (``finer_lengths``):
    #: their cells compile after the others are in use.
    between: frozenset[int] = frozenset()
    #: (with ``overlap``) Beside the steps or between two by the tokens/s each way
    #: makes while serving (``overlap_prefill`` left to its default).
    placement: bool = False
    #: Seconds per phase of the load.
    phases: dict[str, float] = dataclasses.field(default_factory=dict)


def _plan(
    art: Any,
    n_dev: int,
    in_group: bool,
    *,
    slots: int | None,
    max_length: int | None,
    prefill_lengths: Sequence[int] | None,
    prefill_batches: Sequence[int] | None,
    chunk_lengths: Sequence[int] | None,
    chunk_batches: Sequence[int] | None,
    prefix_cache_tokens: int | None,
    prefix_block: int,
    step_slots: Sequence[int] | None,
    step_lengths: Sequence[int] | None,
    speculative_tokens: int,
    max_waiting: int,
    sampling_controls: bool,
    chunk_tokens: int | None,
    itl_bound_ms: float | None,
    overlap_prefill: bool | None = None,
    devices: Sequence = (),
    multi_step: int | None = None,
    length_tiers: str | Sequence[tuple[int, int]] | None = None,
) -> _Plan:
    """``load_decoder``'s options checked, and the sizes they leave (``_Plan``)."""
    tiers, auto = _tier_option(art, n_dev, in_group, length_tiers, speculative_tokens)
    if tiers:  # (the slots and the cache's length are the tiers'; what they leave out)
        slots, max_length = _tier_sizes(tiers, length_tiers, slots, max_length)
        if speculative_tokens:
            raise ValueError("speculative_tokens: not with length_tiers (yet)")
        step_slots, step_lengths = (), ()
    slots, max_length, lengths, batches = _sizes(
        art.config, art.bounds, n_dev, slots, max_length, prefill_lengths, prefill_batches
    )
    between: frozenset[int] = frozenset()
    if prefill_lengths is None and "num_devices" not in art.config and not in_group:
        given, lengths = lengths, finer_lengths(lengths)
        between = frozenset(lengths) - frozenset(given)
    if auto is None:  # (unset: where it was measured to pay, ``AUTO_TIERS``)
        cpu = bool(devices) and all(d.platform == "cpu" for d in devices)
        auto = cpu and slots >= AUTO_TIERS and not in_group and not speculative_tokens
    chunks, chunk_rows = _chunk_sizes(art, max_length, chunk_lengths, chunk_batches)
    if in_group and chunks:
        # Followers run only prefill cells and the step (pxrt.multihost).
        log.info("pxrt: %s: in a multi-host group prompts are not chunked or cached", art.name)
        chunks, chunk_rows, prefix_cache_tokens = [], [], 0
    positions = sum(n * length for n, length in tiers) if tiers else slots * max_length
    prefix = _prefix_pool(art, positions, max_length, chunks, prefix_cache_tokens, prefix_block)
    parts = _step_slots(art, slots, n_dev, step_slots, in_group)
    windows = _step_lengths(art, max_length, step_lengths, in_group)
    speculative_tokens = int_in("speculative_tokens", speculative_tokens, 0, max_length - 2)
    if speculative_tokens and (not chunks or in_group or "num_devices" in art.config):
        raise ValueError(
            f"speculative_tokens: {art.name!r} cannot verify drafts: that takes an extend "
            "program with symbolic shapes (export_decoder(extend=...)), in one process"
        )
    max_waiting = int_in("max_waiting", max_waiting, 1, None)
    if not isinstance(sampling_controls, (bool, np.bool_)):
        raise ValueError(f"sampling_controls must be true or false, got {sampling_controls!r}")
    if chunk_tokens is not None:
        chunk_tokens = int_in("chunk_tokens", chunk_tokens, 1, None)
    if itl_bound_ms is not None:
        itl_bound_ms = number_in("itl_bound_ms", itl_bound_ms, 0.0, 1e6, low_open=True)
    placement = overlap_prefill is None
    if overlap_prefill is None:
        overlap_prefill = not in_group and all(d.platform == "cpu" for d in devices)
    elif not isinstance(overlap_prefill, (bool, np.bool_)):
        raise ValueError(f"overlap_prefill must be true or false, got {overlap_prefill!r}")
    elif overlap_prefill and in_group:
        raise ValueError("overlap_prefill: a multi-host group's followers prefill in turn")
    multi_step = int_in("multi_step", MULTI_STEP if multi_step is None else multi_step, 1, 64)
    if in_group or speculative_tokens:  # (followers run single steps; verify is one)
        multi_step = 1
    return _Plan(
        slots, max_length, lengths, batches, chunks, chunk_rows, prefix, parts, windows,
        speculative_tokens, max_waiting, bool(sampling_controls), chunk_tokens, itl_bound_ms,
        bool(overlap_prefill), multi_step, tiers=tiers, auto_tiers=bool(auto), between=between,
        placement=placement,
    )  # fmt: skip


def _tier_option(
    art: Any, n_dev: int, in_group: bool, given: Any, speculative_tokens: int
) -> tuple[tuple[tuple[int, int], ...], bool | None]:
    """``length_tiers`` checked: (the tiers given, whether they are learned from the
    traffic: True for ``"auto"``, None when unset, decided once the slots are known)."""
    word = given.strip() if isinstance(given, str) else None
    if word == "auto":  # (one cache first, tiers once the traffic has sized them)
        if in_group:
            raise ValueError("length_tiers: not in a multi-host group")
        if speculative_tokens:
            raise ValueError("speculative_tokens: not with length_tiers (yet)")
    tiers = _tiers(art, n_dev, in_group, None if word in ("auto", "off") else given)
    return tiers, True if word == "auto" else None if given is None else False


def _tier_sizes(
    tiers: tuple[tuple[int, int], ...], given: Any, slots: int | None, max_length: int | None
) -> tuple[int, int]:
    """(slots, max_length) of ``tiers``: their sum and the longest; given ones must agree."""
    total, longest = sum(n for n, _ in tiers), tiers[-1][1]
    if slots is not None and slots != total:
        raise ValueError(
            f"slots: {slots}, but length_tiers {given!r} hold {total} (leave slots out)"
        )
    if max_length is not None and max_length != longest:
        raise ValueError(
            f"max_length: {max_length}, but the longest of length_tiers {given!r} is "
            f"{longest} (leave max_length out)"
        )
    return total, longest


def _tiers(
    art: Any, n_dev: int, in_group: bool, given: str | Sequence[tuple[int, int]] | None
) -> tuple[tuple[int, int], ...]:
    """``length_tiers`` checked: (slots, positions) per tier, shortest first."""
    if given is None or given == () or given == "":
        return ()
    form = "length_tiers takes slots x positions per tier, e.g. '20x128+10x256+2x512'"
    try:
        tiers = (
            tier_pairs(given.replace(" ", "")) if isinstance(given, str)
            else [(int(n), int(length)) for n, length in given]
        )  # fmt: skip
    except (TypeError, ValueError):
        raise ValueError(f"{form}; got {given!r}") from None
    if in_group:
        raise ValueError("length_tiers: not in a multi-host group")
    for n, _ in tiers:
        if n < 1 or n % n_dev:
            raise ValueError(
                f"length_tiers: each tier's slots must be a positive multiple of the "
                f"{n_dev} devices (the cache is sharded by slot); got {n} in {given!r}"
            )
    shapes.check_lengths("length_tiers", LENGTH_DIM, [t[1] for t in tiers], art.bounds)
    if len({length for _, length in tiers}) != len(tiers):
        raise ValueError(f"length_tiers: one tier per length; got {given!r}")
    return tuple(sorted(tiers, key=lambda t: t[1]))


@dataclasses.dataclass
class _Built:
    """A load's programs, obtained and warmed up: the programs' builder, the jobs
    obtained and those left for later, the params and the state on the devices, and
    the programs' measured costs."""

    programs: DecoderPrograms
    jobs: list[tuple[str, int, int]]
    later: list[tuple[str, int, int]]
    got: _Obtained
    params: Any
    state: Any
    costs: dict[str, float]


def _build(
    art: Any,
    devices: list,
    plan: _Plan,
    cache_dir: str | None,
    progress: bool | None,
    defer: Any,
    in_group: bool,
) -> _Built:
    """Build the programs, obtain those needed now (stored, or compiled), place the
    params, warm the programs up and measure them; the memory checked before each."""
    with _xla.x64_scope(art.x64), _xla.persistent_cache(cache_dir):
        programs = _programs(art, devices, plan, in_group)
        # Refused before anything is placed or compiled when the cache alone cannot fit
        # (slots = 100000 would otherwise allocate until the kernel kills the process),
        # and again, with the programs' work space, before the params and the cache are
        # placed.
        check_memory(programs)
        jobs = programs.jobs(plan.lengths, plan.batches, plan.chunks, plan.chunk_rows)
        if not isinstance(defer, (bool, np.bool_)):
            raise ValueError(f"defer must be true or false, got {defer!r}")
        jobs, later = _split(jobs, bool(defer) and not in_group, plan.between)
        tp = time.perf_counter()
        got = _obtain_all(programs, jobs, cache_dir, progress, store=not in_group)
        tw = time.perf_counter()
        check_memory(programs, got.work_bytes)
        params_dev = programs.place(art.params)
        try:
            got.warm_up(params_dev, plan.slots)
        except Exception:
            if not got.sources.get("stored"):
                raise
            # A stored executable that does not run: every program compiled afresh.
            got = _obtain_all(programs, jobs, cache_dir, progress, store=True, fresh=True)
            tw = time.perf_counter()
            got.warm_up(params_dev, plan.slots)
        tm = time.perf_counter()
        # The scheduler's prices: what each prefill cell and step takes here (not in a
        # multi-host group, whose followers run every program the leader runs).
        costs = {} if in_group else got.measure(params_dev, plan.slots)
        state = got.make_state()
        # Where the time went: tracing and compiling (or loading) the programs, then
        # placing the params and one run of each, then timing them.
        plan.phases |= {
            "programs": tw - tp,
            "warm-up": tm - tw,
            "measure": time.perf_counter() - tm,
        }
    return _Built(programs, jobs, later, got, params_dev, state, costs)


def _programs(
    art: Any, devices: list, plan: _Plan, in_group: bool, relayout_from: Sequence = ()
) -> DecoderPrograms:
    """The programs of ``plan``, not compiled yet (``relayout_from``: a running
    decoder's layout, for tiers it changes into)."""
    return DecoderPrograms(
        art,
        devices,
        plan.slots,
        plan.max_length,
        in_group=in_group,
        prefix=plan.prefix,
        rows=plan.chunk_rows,
        step_slots=plan.parts,
        step_lengths=plan.windows,
        speculate=plan.speculative_tokens,
        controls=plan.controls,
        overlap=plan.overlap,
        multi_step=plan.multi_step,
        tiers=plan.tiers,
        relayout_from=relayout_from,
    )


def _fingerprint(art: Any, devices: list, plan: _Plan, built: _Built) -> Any:
    """What every process of a multi-host group must have loaded alike."""
    from .. import multihost

    jobs = [list(job) for job in built.jobs] + [[plan.slots, plan.max_length]]
    return multihost.fingerprint(art.manifest, jobs, len(devices))


def _follower(
    distributed: Any, art: Any, devices: list, plan: _Plan, built: _Built, t0: float
) -> Any:
    """A multi-host follower's ``multihost.Follower``: it runs the leader's prefill
    cells, steps and state resets on its shards."""
    from .. import multihost

    got = built.got
    holder = _FollowerState(built.params, built.state, art.x64)
    followed: list[Any] = [
        _FollowerProgram(holder, c.compiled, c.batch, c.length) for c in got.cells
    ]
    followed += [
        _FollowerProgram(holder, got.step, 0, 0),
        _FollowerProgram(holder, got.make_state, -1, 0),
    ]
    fp = _fingerprint(art, devices, plan, built)
    return multihost.Follower(distributed, art.name, followed, fp, time.perf_counter() - t0)


def _join_group(distributed: Any, art: Any, devices: list, plan: _Plan, built: _Built) -> Any:
    """A multi-host leader's ``multihost.Group``, its followers joined."""
    from .. import multihost

    fp = _fingerprint(art, devices, plan, built)
    group = multihost.Group(distributed)
    try:
        group.accept(fp)
    except BaseException:
        group.close()
        raise
    return group


def _decoder(art: Any, devices: list, plan: _Plan, built: _Built, t0: float) -> Decoder:
    """The ``Decoder`` over a load's programs."""
    got = built.got
    decoder = Decoder(
        art,
        devices,
        built.params,
        built.state,
        got.step,
        got.cells,
        got.make_state,
        extends=got.extends,
        prefix=got.prefix,
        chunk_tokens=plan.chunk_tokens,
        parts=got.parts,
        windows=got.windows,
        move=got.move,
        control=got.control,
        verify=got.verify,
        speculative_tokens=got.verify_width,
        full_step=got.full_step,
        slots=plan.slots,
        max_length=plan.max_length,
        max_waiting=plan.max_waiting,
        costs=built.costs,
        itl_bound_ms=plan.itl_bound_ms,
        overlap_prefill=plan.overlap,
        measured_placement=plan.placement,
        multi_step=plan.multi_step,
        tiers=plan.tiers,
        deferred=len(built.later),
        prefill_lengths=plan.lengths,
        wanted={
            "controls": built.programs.controls,
            "speculative_tokens": plan.speculative_tokens,
        },
        step_compile_s=got.step_s,
        load_s=time.perf_counter() - t0,
    )
    #: Where each program came from: "compiled", "cache" (jax's persistent cache) or
    #: "stored" (pxrt's stored executables) -> how many.
    decoder.program_sources = dict(got.sources)
    decoder.load_phases = {k: round(v, 4) for k, v in plan.phases.items()}
    return decoder


def check_memory(programs: DecoderPrograms, work: int = 0) -> None:
    """Refuse a load whose memory would not fit, before any of it is allocated: on each
    device the params, its share of the cache state (sharded by slot), the prefix pool
    and ``work`` (the programs' work space, once compiled), against the host's available
    memory for CPU devices (``compiling.available_host_bytes``) and what its backend
    reports free for the others (as ``compiling.check_memory`` does for one-shot
    loads)."""
    art, slots = programs.art, programs.slots
    params = sum(_nbytes(a) for a in jax.tree.leaves(art.params))
    state = sum(_nbytes(s) for s in jax.tree.leaves(programs.shapes))
    pool = sum(_nbytes(s) for s in jax.tree.leaves(programs.pool_shapes)) if programs.prefix else 0
    per_device = params + pool + work + -(-state // len(programs.devices))
    gib = compiling._gib
    parts = [f"the cache state {gib(state)}, {state // slots} bytes a slot"]
    if pool:
        parts.append(f"the prefix cache {gib(pool)} on each device")
    parts.append(f"params {gib(params)} on each device")
    if work:
        parts.append(f"the programs' work space {gib(work)} on each device")
    what = f"{art.name!r} with slots={slots} and max_length={programs.max_length}"
    advice = "load it with fewer slots, a smaller max_length" + (
        " or fewer prefix_cache_tokens" if pool else ""
    )
    here = jax.process_index()
    local = [d for d in programs.devices if d.process_index == here]
    on_host = [d for d in local if d.platform == "cpu"]
    free = compiling.available_host_bytes() if on_host else None
    if free is not None and per_device * len(on_host) > free:
        raise ValueError(
            f"{what} needs about {gib(per_device * len(on_host))} of host memory, "
            f"{gib(per_device)} for each of {len(on_host)} CPU devices ({'; '.join(parts)}), "
            f"and {gib(free)} is available: {advice}"
        )
    for d in local:
        left = compiling.device_free_bytes(d)
        if left is not None and per_device > left:
            raise ValueError(
                f"{what} needs about {gib(per_device)} on {d} ({'; '.join(parts)}) and "
                f"{gib(left)} is free there: {advice}"
            )


def _nbytes(a: Any) -> int:
    return math.prod(a.shape) * np.dtype(a.dtype).itemsize


def _work_bytes(compiled: Any) -> int:
    """A compiled program's work space on a device (its temporaries and code), 0 where
    the backend does not say."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - an executable that cannot analyse itself
        return 0
    if stats is None:
        return 0
    return int(stats.temp_size_in_bytes) + int(stats.generated_code_size_in_bytes)


def _chunk_sizes(
    art: Any,
    max_length: int,
    chunk_lengths: Sequence[int] | None,
    chunk_batches: Sequence[int] | None,
) -> tuple[list[int], list[int]]:
    """The load's extend sizes (chunk lengths, rows): given, else the artifact's; none
    for a decoder without ``extend``."""
    config = art.config
    if not art.chunked:
        if chunk_lengths is not None or chunk_batches is not None:
            raise ValueError(
                f"{art.name!r} has no extend program, so chunk_lengths and chunk_batches do "
                "not apply: export it with extend= to chunk prompts"
            )
        return [], []
    chunks = sizes(
        "chunk_lengths", config["chunk_lengths"] if chunk_lengths is None else chunk_lengths
    )
    rows = sizes(
        "chunk_batches", config["chunk_batches"] if chunk_batches is None else chunk_batches
    )
    if chunks[-1] > max_length:
        raise ValueError(f"chunk_lengths go up to {chunks[-1]}, over max_length {max_length}")
    shapes.check_lengths("chunk_lengths", CHUNK_DIM, chunks, art.bounds)
    if "num_devices" in config:
        _traced(config, {"chunk_lengths": chunks, "chunk_batches": rows})
    return list(chunks), list(rows)


def _traced(config: dict, chosen: dict[str, Sequence[int]]) -> None:
    """A concrete-shape decoder loads the sizes it was traced at, no others."""
    for field, sizes_ in chosen.items():
        untraced = sorted(set(sizes_) - set(config[field]))
        if untraced:
            raise ValueError(
                f"this decoder was exported with shapes='concrete' for {field} "
                f"{config[field]}; {untraced} were not traced"
            )


def _step_slots(
    art: Any, slots: int, n_dev: int, given: Sequence[int] | None, in_group: bool
) -> list[int]:
    """The smaller steps' slot counts: given, else a quarter and a half of the slots,
    each rounded up to a multiple of the devices; none in a multi-host group (its
    followers run the full step only) or for concrete shapes (decode was traced at the
    full count only)."""
    if given is None:
        if in_group or "num_devices" in art.config:
            return []
        given = [slots // 4, slots // 2]
    elif given:
        given = sizes("step_slots", given)
        if in_group or "num_devices" in art.config:
            raise ValueError(
                "step_slots: a multi-host group, or a decoder exported with concrete shapes, "
                "steps all its slots"
            )
    out = sorted({-(-max(n, 1) // n_dev) * n_dev for n in given} - {slots})
    over = [n for n in out if n > slots]
    if over:
        raise ValueError(f"step_slots {over} are over slots={slots}")
    return out


def _step_lengths(
    art: Any, max_length: int, given: Sequence[int] | None, in_group: bool
) -> list[int]:
    """The cache windows the steps are also compiled for: given, else a quarter and a
    half of ``max_length`` when it is 256 or more; none in a multi-host group, for
    concrete shapes (decode was traced at the full length only) or when a cache leaf
    has no sequence axis (a state the window could not cut)."""
    cannot = (
        "a multi-host group" if in_group
        else "a decoder exported with concrete shapes" if "num_devices" in art.config
        else f"a decoder with a cache leaf without a {LENGTH_DIM!r} axis"
        if any(LENGTH_DIM not in s.shape for s in jax.tree.leaves(art.cache, is_leaf=is_spec))
        else None
    )  # fmt: skip
    if given is None:
        if cannot or max_length < 256:
            return []
        return [max_length // 4, max_length // 2]
    if not given:
        return []
    if cannot:
        raise ValueError(f"step_lengths: {cannot} steps over its whole cache")
    out = sorted(set(sizes("step_lengths", given)) - {max_length})
    over = [n for n in out if n > max_length]
    if over:
        raise ValueError(f"step_lengths {over} are over max_length={max_length}")
    return out


def _prefix_pool(
    art: Any,
    positions: int,
    max_length: int,
    chunks: list[int],
    tokens: int | None,
    block: int,
) -> tuple[int, int] | None:
    """The prefix cache's (pool entries, block tokens), or None: off. It needs extend
    (to prefill what follows a cached start) and a sequence axis on every cache leaf.
    By default it holds half as many tokens as the slots' cache (``positions``)."""
    block = int_in("prefix_block", block, 1, max_length - 1)
    if tokens is not None:
        tokens = int_in("prefix_cache_tokens", tokens, 0, None)
    if tokens == 0:
        return None
    why = None
    if not chunks:
        why = "it has no extend program (export it with extend=)"
    elif any(LENGTH_DIM not in s.shape for s in jax.tree.leaves(art.cache, is_leaf=is_spec)):
        why = f"a leaf of its cache has no {LENGTH_DIM!r} axis to cut into blocks"
    if why is not None:
        if tokens is not None:
            raise ValueError(f"prefix_cache_tokens: {art.name!r} cannot cache prefixes: {why}")
        return None
    if tokens is None:
        tokens = positions // 2
    blocks = tokens // block
    if blocks < 1:
        raise ValueError(
            f"prefix_cache_tokens={tokens} holds no block of prefix_block={block} tokens"
        )
    return blocks, block


def finer_lengths(lengths: Sequence[int]) -> list[int]:
    """The prefill lengths a load compiles by default: the artifact's, and between two
    of them from 32 up, every multiple of a quarter of the shorter (at least 16, and a
    multiple of every length given: a model's own divisibility), so that a prompt pays
    for at most a quarter of its bucket in padding rather than up to half of it. The
    prefill is up to half of a small decoder's work on a CPU, and padding to powers of
    two costs ~1.4x the prompt tokens: with 16, 32, 48, 64, 80, ... 224, 256 against
    the powers of two, 1.08-1.11x tokens/s at 8 slots (``docs/generation.md``)."""
    lengths = sorted(set(lengths))
    unit = math.gcd(*lengths)
    out = list(lengths)
    for short, long in zip(lengths, lengths[1:]):
        if short < 32:
            continue
        step = -(-max(16, short // 4) // unit) * unit
        out += range(short + step, long, step)
    return sorted(set(out))


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
        _traced(config, {"prefill_lengths": lengths, "prefill_batches": batches})
    return slots, max_length, list(lengths), list(batches)


@dataclasses.dataclass
class _Obtained:
    """A load's compiled programs: the empty state, the step, the prefill cells, the
    extend cells, and the prefix pool's programs (empty pool, copy, save)."""

    make_state: Any
    step: Any
    step_s: float
    cells: list[PrefillCell]
    sources: collections.Counter
    extends: list[PrefillCell] = dataclasses.field(default_factory=list)
    prefix: PrefixPool | None = None
    #: The steps over fewer slots: slot count -> program; and the slot move.
    parts: dict[int, Any] = dataclasses.field(default_factory=dict)
    move: Any = None
    #: Writes a slot's sampling controls (none in a multi-host group).
    control: Any = None
    max_length: int = 0
    #: Speculative decoding's verify program (drafts of ``verify_width``), or None.
    verify: Any = None
    verify_width: int = 0
    #: The step with the sampling controls and scores (none in a multi-host group).
    full_step: Any = None
    #: The largest work space (bytes on a device) of one of the programs.
    work_bytes: int = 0
    #: The steps over a cache window: (slot count, window) -> program.
    windows: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    #: Seconds a run of the steps compiled after the load (``time_steps``).
    step_costs: dict[str, float] = dataclasses.field(default_factory=dict)
    #: (tiers) The one cache's state of a running decoder into this layout, or None.
    relayout: Any = None

    def time_steps(self, params: Any, state: Any, budget_s: float = 0.05) -> None:
        """Time the steps over fewer slots and over cache windows (``step_costs``, as
        ``measure`` names them), and the controls' step's forwards by window
        (``forward[w]``), on ``state``, a state of their own (zeros: the same work as
        a real call)."""
        holder = [state]
        full = self.full_step
        forwards = sorted(full.forwards.items()) if full is not None else []

        def forward(run: Any) -> Any:  # (the forward of the step with the controls)
            def call(params: Any, state: Any) -> Any:
                state, logits = run(params, state)
                return state, logits, None

            return call

        for key, part in [
            *((f"step[{n}]", p) for n, p in sorted(self.parts.items())),
            *((f"step[{n},{w}]", p) for (n, w), p in sorted(self.windows.items())),
            *((f"forward[{w}]", forward(f)) for w, f in forwards if len(forwards) > 1),
        ]:
            times: list[float] = []
            while len(times) < 4 and sum(times) < budget_s:
                t0 = time.perf_counter()
                holder[0], first, _ = part(params, holder[0])
                jax.block_until_ready(first)
                times.append(time.perf_counter() - t0)
            self.step_costs[key] = float(np.median(times[1:] or times))

    def warm_up(self, params: Any, slots: int) -> None:
        """One run of each program (on the zero state: no slot is busy, every row is
        dropped) so that the first request does not pay for first-run work."""
        state = self.make_state()
        c = sampling
        for cell in self.cells:
            args = dropped_prefill(cell, slots)
            state, first, _ = cell.compiled(params, state, *args)
        for cell in self.extends:
            ints = np.zeros((cell.batch, c.CHUNK_INTS), np.int32)
            ints[:, c.CHUNK_COUNT] = 1
            ints[:, c.CHUNK_SLOT] = slots
            floats = np.ones((cell.batch, c.FLOATS), np.float32)
            tokens = np.zeros((cell.batch, cell.length), np.int32)
            state, first, *_ = cell.compiled(params, state, tokens, ints, floats)
        if self.control is not None:
            state = self.control(
                state,
                np.full(1, slots, np.int32),
                np.zeros((1, self.max_length), np.int32),
                np.zeros((1, c.MAX_LOGIT_BIAS), np.int32),
                np.zeros((1, c.MAX_LOGIT_BIAS), np.float32),
                np.zeros((1, c.MAX_BANNED), np.int32),
                np.zeros((1, state["allowed"].shape[-1]), np.int32),
            )
        prefix = self.prefix
        if prefix is not None:
            rows, width = prefix.rows, prefix.width
            dropped = np.full(rows, slots, np.int32)
            state = prefix.load(state, prefix.pool, dropped, np.zeros((rows, width), np.int32))
            entries = prefix.index.blocks
            none = np.full(width, entries, np.int32)
            prefix.pool = prefix.save(prefix.pool, state, none, np.zeros(width, np.int32), none)
            jax.block_until_ready(prefix.pool)
        for part in [*self.parts.values(), *self.windows.values()]:
            state, first, _ = part(params, state)
        if self.move is not None:
            none = np.full(slots, slots, np.int32)
            state = self.move(state, none, none)
        if self.full_step is not None:
            state, first, _ = self.full_step(params, state)
            for forward in self.full_step.forwards.values():
                state, logits = forward(params, state)
                state, first, _ = self.full_step.pick(state, logits, self.full_step._all)
        if self.verify is not None:
            k = self.verify_width
            state, _, _ = self.verify(params, state, np.full((slots, k), -1, np.int32))
        state, first, _ = self.step(params, state)
        np.asarray(first.addressable_data(0))  # (the group's: a shard)

    def _launch(self, params: Any, holder: list, budget_s: float, price: float) -> float:
        """Seconds a step program costs besides its steps' device time: the step's
        ``price`` (what the scheduler prices it at) less what each further step of a
        block of K adds (the block and one step timed alternately, the least of up to
        3 of each: noise on a shared host only adds). So the price less the launch is
        a step's device time, whatever noise the price met (the least single step
        less it, against the price's median, made blocks of 3 steps on one TPU load
        and of 4 on another, the same programs). On a TPU v5e ~0.9 ms against 0.17 ms
        a step of a small model; on a CPU a small share of the step."""
        k = self.step.steps
        ones: list[float] = []
        blocks: list[float] = []
        while len(ones) < 3 and sum(ones) + sum(blocks) < budget_s:
            for n, times in ((1, ones), (k, blocks)):
                t0 = time.perf_counter()
                holder[0], first, _ = self.step(params, holder[0], n)
                jax.block_until_ready(first)
                times.append(time.perf_counter() - t0)
        each = max((min(blocks) - min(ones)) / (k - 1), 0.0)
        return min(max(price - each, 0.0), price)

    def measure(self, params: Any, slots: int, budget_s: float = 0.05) -> dict[str, float]:
        """Seconds per run of the programs the loop's scheduler chooses among (each
        prefill cell, each step size, the controls' step's forwards by window), on the
        zero state (every row dropped: the same shapes and work as a real call): the
        median of up to 5 runs, fewer where a program takes over ``budget_s``; and
        ``dispatch``, the host's own time to hand one prefill to the device;
        ``launch``, a step program's cost apart from its steps' device time (blocks
        of steps). Warm programs only (``warm_up`` first)."""
        holder = [self.make_state()]
        costs: dict[str, float] = {}

        def timed(key: str, run: Any) -> None:
            times: list[float] = []
            while len(times) < 5 and sum(times) < budget_s:
                t0 = time.perf_counter()
                jax.block_until_ready(run())
                times.append(time.perf_counter() - t0)
            costs[key] = float(np.median(times))

        dispatch: list[float] = []
        for cell in self.cells:

            def prefill(
                cell: Any = cell, args: tuple = dropped_prefill(cell, slots)
            ) -> Any:
                t0 = time.perf_counter()
                holder[0], first, _ = cell.compiled(params, holder[0], *args)
                dispatch.append(time.perf_counter() - t0)
                return first

            timed(f"prefill[{cell.batch},{cell.length}]", prefill)
        for rows, part in sorted({**self.parts, slots: self.step}.items()):

            def step(part: Any = part) -> Any:
                holder[0], first, _ = part(params, holder[0])
                return first

            timed(f"step[{rows}]", step)
        if getattr(self.step, "steps", 1) > 1:
            costs["launch"] = self._launch(params, holder, budget_s, costs[f"step[{slots}]"])
        for (rows, window), part in sorted(self.windows.items()):

            def windowed(part: Any = part) -> Any:
                holder[0], first, _ = part(params, holder[0])
                return first

            timed(f"step[{rows},{window}]", windowed)
        forwards = self.full_step.forwards if self.full_step is not None else {}
        for window, run in sorted(forwards.items()) if len(forwards) > 1 else ():

            def forward(run: Any = run) -> Any:
                holder[0], logits = run(params, holder[0])
                return logits

            timed(f"forward[{window}]", forward)
        costs["dispatch"] = float(np.median(dispatch)) if dispatch else 0.0
        return costs


def _obtain_all(
    programs: DecoderPrograms,
    jobs: list[tuple[str, int, int]],
    cache_dir: str | None,
    progress: bool | None,
    *,
    store: bool,
    fresh: bool = False,
    stop: Any = None,
    given: dict | None = None,
) -> _Obtained:
    """Every program of ``jobs``, on a pool (XLA's compile releases the GIL), each by
    ``pxrt.compiling.obtain``; those of ``jobs`` it holds, for a part of a load (the
    state and the step must be in the first part). ``stop()`` true: the jobs not yet
    begun are left out. ``given``: programs compiled before (job -> (compiled,
    seconds, source)), taken as they are."""
    art = programs.art
    bar = compiling.progress_bar(len(jobs), f"pxrt: compiling {art.name}", "program", progress)

    def one(job: tuple[str, int, int]) -> tuple[Any, float, str] | None:
        if stop is not None and stop():
            return None
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
        got = {job: out for job, out in zip(jobs, pool.map(one, jobs)) if out is not None}

    return _obtained(programs, (given or {}) | got)


def _cells(programs: DecoderPrograms, got: dict, kind: str, box: Any = None) -> list[PrefillCell]:
    """The obtained prefill (a split one's rows and insert together) or extend cells;
    ``index``: the cell's place among its kind (a multi-host header names it). With the
    prefix cache a prefill cell saves into ``box``'s pool (``Saving``; none: the
    decoder binds it to its own when it takes the cell, ``Runner._bound``)."""
    mine = [(job, out) for job, out in got.items() if job[0] == kind]
    saving = kind == "prefill" and programs.prefix is not None
    # (a prefill's insert, its state argument at ``at``)
    pooled = lambda compiled, at: Saving(compiled, box, at) if saving else compiled  # noqa: E731
    if kind == "prefill" and programs.overlap:  # each cell's rows and insert
        mine = [
            (job, (SplitPrefill(out[0], pooled(got[("insert", *job[1:])][0], 0)), *out[1:]))
            for job, out in got.items()
            if job[0] == "rows" and ("insert", *job[1:]) in got
        ]
    else:  # (one host input: ``Packed``)
        mine = [(job, (Packed(pooled(out[0], 1)), *out[1:])) for job, out in mine]
    columns = programs.prefill_ints if saving else sampling.INTS
    return [
        PrefillCell(b, n, compiled, compile_s, i, columns)
        for i, ((_, b, n), (compiled, compile_s, _)) in enumerate(mine)
    ]


def _obtained(programs: DecoderPrograms, got: dict) -> _Obtained:
    """``_Obtained`` over the programs obtained (``got``: job -> (compiled, seconds,
    source)); the plain steps as blocks (``BlockStep``) with ``multi_step``."""

    def program(*job: Any) -> Any:
        return got[job][0] if job in got else None

    def stepper(compiled: Any) -> Any:  # (a block of steps, called as one step)
        if compiled is None or programs.multi_step <= 1:
            return compiled
        return BlockStep(compiled, programs.multi_step, programs.replicated)

    def full_step(compiled: Any) -> Any:  # (the allowed tokens: all unless given)
        if compiled is None:
            return None
        words = grammar.words(programs.vocab)
        forwards = {w: program("forward", 0, w) for w in (0, *programs.step_lengths)}
        pick = program("pick", 0, 0)
        return FullStep(compiled, programs.slots, words, programs.by_slot, forwards, pick)

    prefix = box = None
    if programs.prefix is not None and all((what, 0, 0) in got for what in POOL):
        entries, block = programs.prefix
        make, load, save = (got[(what, 0, 0)][0] for what in POOL)
        box = PoolBox(make)  # (the decoder's pool, or scratch until ``Runner._bound``)
        prefix = PrefixPool(
            PrefixIndex(entries, block), box, load, save, programs.load_rows, programs.width
        )
    step = got.get(("step", 0, 0), (None, 0.0, ""))
    verify = program("verify", 0, programs.speculate) if programs.speculate else None
    return _Obtained(
        program("state", 0, 0),
        stepper(step[0]),
        step[1],
        _cells(programs, got, "prefill", box),
        collections.Counter(source for _, _, source in got.values()),
        _cells(programs, got, "extend"),
        prefix,
        {n: stepper(program("step", n, 0)) for n in programs.step_slots if ("step", n, 0) in got},
        program("move", 0, 0),
        program("control", 0, 0),
        programs.max_length,
        verify,
        programs.speculate if verify is not None else 0,
        full_step(program("step", -1, 0)),
        max((_work_bytes(compiled) for compiled, _, _ in got.values()), default=0),
        {
            (n, w): stepper(program("step", n, w))
            for n, w in programs._window_jits
            if ("step", n, w) in got
        },
        relayout=program("relayout", 0, 0),
    )


def _split(
    jobs: list[tuple[str, int, int]], defer: bool, between: Collection[int] = frozenset()
) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """(the programs a decoder needs to be ready, those compiled after it is): with
    ``defer``, the state, the step over every slot and the cache, and a way in for
    every prompt (the 1-row extend cells, or without extend the smallest prefill cells
    of the lengths not ``between`` others) first; the steps over fewer slots or
    positions, the other cells, and the sampling controls', the prefix cache's and
    speculation's programs after."""
    if not defer:
        return jobs, []
    # The way in: the smallest extend cell of each chunk length (a prompt of any length
    # goes in chunks until its prefill cell comes), else the smallest prefill cells.
    # (a cell in two programs, ``rows`` and ``insert``, goes as one)
    way_in = {"extend"} if any(job[0] == "extend" for job in jobs) else {"prefill", "rows"}
    least = min(b for k, b, _ in jobs if k in way_in)
    way_in |= {"insert"} if "rows" in way_in else set()
    core = [
        job for job in jobs
        if job[:2] in (("state", 0), ("step", 0)) and job[2] == 0
        or job[0] in way_in and job[1] == least and job[2] not in between
    ]  # fmt: skip
    return core, [job for job in jobs if job not in core]


# Threads compiling a load's later programs: joined at exit (a compile that outlived the
# interpreter would run while jax tears its backends down).
_LATER: set[threading.Thread] = set()
_STOPPING = threading.Event()


@atexit.register
def _join_later() -> None:
    _STOPPING.set()
    for thread in list(_LATER):
        thread.join(timeout=60)


def _room_for_a_state(programs: DecoderPrograms) -> bool:
    """Whether a second state fits beside the decoder's (to time the later steps on):
    in the host's available memory for CPU devices, in what the others report free."""
    state = sum(_nbytes(s) for s in jax.tree.leaves(programs.shapes))
    per_device = -(-state // len(programs.devices))
    if all(d.platform == "cpu" for d in programs.devices):
        free = compiling.available_host_bytes()
        return free is not None and 2 * state < free
    for d in programs.devices:
        left = compiling.device_free_bytes(d)
        if left is None or 2 * per_device >= left:
            return False
    return True


def _in_background(
    decoder: Any, art: Any, cache_dir: str | None, what: str, work: Any, deliver: Any
) -> None:
    """``work(stop)`` on a thread of its own (in the artifact's x64 scope, with the
    compilation cache), its result or its error handed to ``deliver(decoder, got,
    error)``; ``stop()`` turns true once the decoder is closed or dropped (the jobs not
    begun are left out)."""
    ref = weakref.ref(decoder)

    def stop() -> bool:
        dec = ref()
        return _STOPPING.is_set() or dec is None or dec.closed

    def run() -> None:
        got, error = None, None
        try:
            with _xla.x64_scope(art.x64), _xla.persistent_cache(cache_dir):
                got = work(stop)
        except Exception as exc:  # noqa: BLE001 - the decoder serves on without them
            error = exc
            log.error("pxrt: %s: %s failed: %r", art.name, what, exc)
        finally:
            _LATER.discard(threading.current_thread())
        dec = ref()
        if dec is not None:
            deliver(dec, got, error)

    thread = threading.Thread(target=run, name=f"pxrt-compile-{art.name}", daemon=True)
    _LATER.add(thread)
    thread.start()


def _compile_later(
    decoder: Any,
    programs: DecoderPrograms,
    jobs: list[tuple[str, int, int]],
    cache_dir: str | None,
    params: Any,
    make_state: Any,
    between: Collection[int] = frozenset(),
) -> None:
    """Compile ``jobs`` on a thread of their own, time the steps among them on a
    state of their own when one fits beside the decoder's (the loop runs the cheapest
    step that holds its busy slots), and hand them to ``decoder``'s loop
    (``Decoder.install``), which takes them between two turns. The cells at lengths
    ``between`` the artifact's come after the others are handed over (a prompt runs at
    the next longer length meanwhile): 16 programs more for the demo decoder, which
    would otherwise hold back every deferred one (cold, all in use 1.43x)."""
    ref = weakref.ref(decoder)
    last = [job for job in jobs if job[0] in ("rows", "insert", "prefill") and job[2] in between]
    first = [job for job in jobs if job not in last]

    def work(stop: Any) -> _Obtained:
        got = _obtain_all(programs, first, cache_dir, False, store=True, stop=stop)
        if (got.parts or got.windows) and not stop() and _room_for_a_state(programs):
            got.time_steps(params, make_state())
        dec = ref()
        if not last or dec is None or stop():
            return got
        dec.install(got, None, left=len(last))
        del dec
        return _obtain_all(programs, last, cache_dir, False, store=True, stop=stop)

    _in_background(
        decoder, programs.art, cache_dir, "compiling its later programs", work,
        lambda dec, got, error: dec.install(got, error),
    )  # fmt: skip


def _tier_builder(art: Any, devices: list, plan: _Plan, cache_dir: str | None, params: Any) -> Any:
    """A decoder's way to other length tiers (``Decoder.set_length_tiers``), from one
    cache or tiers: ``build(decoder, length_tiers)`` checks them against its slots and
    ``max_length`` (a ValueError), then on a thread of its own compiles the tiered
    programs (the plan's cells, chunks and prefix pool; no steps over fewer slots or
    windows) and the relayout, warms them up and times them, and hands them to the
    decoder's loop (``_tiers_arrived``). Returns the tiers checked."""

    def build(decoder: Any, given: Any) -> tuple[tuple[int, int], ...]:
        tiers = _tiers(art, len(devices), False, given)
        if not tiers:
            raise ValueError(f"length_tiers: none given ({given!r})")
        _tier_sizes(tiers, given, plan.slots, plan.max_length)
        if tiers == decoder.tiers:
            raise ValueError(f"length_tiers: {decoder.name!r} has {given!r} already")
        tiered = dataclasses.replace(plan, tiers=tiers, parts=[], windows=[], phases={})
        programs = _programs(art, devices, tiered, False, relayout_from=decoder.tiers)
        if not _room_for_a_state(programs):
            raise ValueError(
                f"length_tiers {given!r}: no room for their state beside the one in use"
            )
        # A prefill's rows program reads nothing of the state: the one in use serves.
        rows = {
            ("rows", b, n): (cell.compiled.rows, 0.0, "in use")
            for (b, n), cell in decoder._cells.items()
            if isinstance(cell.compiled, SplitPrefill)
        }
        jobs = programs.jobs(plan.lengths, plan.batches, plan.chunks, plan.chunk_rows)
        jobs = [job for job in jobs if job not in rows] + [("relayout", 0, 0)]

        def work(stop: Any) -> tuple[_Obtained, dict[str, float]] | None:
            got = _obtain_all(programs, jobs, cache_dir, False, store=True, stop=stop, given=rows)
            if stop():
                return None
            got.warm_up(params, plan.slots)
            return got, got.measure(params, plan.slots)

        _in_background(
            decoder, art, cache_dir, f"compiling length tiers {given!r}", work,
            lambda dec, got, error: dec._tiers_arrived(tiers, got, error),
        )  # fmt: skip
        return tiers

    return build


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
            (np.dtype(np.int32), (sampling.INTS,)),
            (np.dtype(np.float32), (sampling.FLOATS,)),
        )
        self.payload_bytes = max(0, batch) * sum(math.prod(s) * d.itemsize for d, s in self.specs)

    def run(self, body: bytearray) -> list:
        from ..multihost import local_rows, split_rows

        h = self.holder
        with _xla.x64_scope(h.x64):
            if self.batch > 0:
                inputs = split_rows(body, self.specs, self.batch)
                h.state, out, _ = self.compiled(h.params, h.state, *inputs)
            elif self.batch == 0:  # the step: its slots' tokens go to the leader
                h.state, out, _ = self.compiled(h.params, h.state)
                return local_rows(out)
            else:
                h.state = out = self.compiled()
        jax.block_until_ready(out)  # answered once done: the leader reads it then
        return []
