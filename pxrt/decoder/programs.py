"""The programs pxrt builds around a decoder artifact's prefill, decode and extend
(``DecoderPrograms``): the empty state, the decode steps with sampling fused in, the
prefill- and extend-inserts, the slot move, the sampling controls' insert, the verify
step and the prefix pool's programs, traced here and lowered for ``pxrt.decoder.load``.
The stored executables' key hashes this module (and ``pxrt.sampling``): the code they
are traced from.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import sampling, stored
from ..artifact import BATCH_AXIS
from ..sampling import sample
from . import grammar
from . import params as _params
from .export import LENGTH_DIM, is_spec
from .relayout import slot_lengths

#: The prefix pool's programs.
POOL = ("pool", "load", "save")


def _where_rows(inside: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    """Row ``r`` of ``new`` where ``inside[r]``, else of ``old``."""
    return jnp.where(inside.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)


def unpacked(packed: jax.Array, n_ints: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens, ints, floats) of a prefill's or a chunk's host inputs sent as one int32
    array ``[rows, length + n_ints + FLOATS]`` (``runner.Packed``: one transfer to the
    device instead of three), the floats' bits as they were."""
    f = packed.shape[1] - sampling.FLOATS
    tokens, ints = packed[:, : f - n_ints], packed[:, f - n_ints : f]
    return tokens, ints, lax.bitcast_convert_type(packed[:, f:], jnp.float32)


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
      write the rows, the token and the sampling parameters into the given slots;
      with ``overlap``, as two programs: ``rows[b, L](params, tokens, ints) -> (rows,
      logits)`` and ``insert[b, L](state, rows, logits, ints, floats) -> (state,
      first)``. With the prefix cache the insert (fused or not) also takes the pool
      after the state and returns it after the state: it saves the prompts' blocks
      that the ints' columns past ``sampling.INTS`` name (``_save_rows``).

    ``in_group``: in a multi-host group the step's tokens stay sharded by slot (each
    follower sends the leader its slots'); in one process they are on every device.
    """

    def __init__(
        self,
        art: Any,
        devices: list,
        slots: int,
        max_length: int,
        *,
        in_group: bool,
        prefix: tuple[int, int] | None = None,
        rows: Sequence[int] = (),
        step_slots: Sequence[int] = (),
        step_lengths: Sequence[int] = (),
        speculate: int = 0,
        controls: bool = True,
        overlap: bool = False,
        multi_step: int = 1,
        tiers: Sequence[tuple[int, int]] = (),
        relayout_from: Sequence[tuple[int, int]] = (),
    ) -> None:
        self.art, self.devices = art, devices
        #: Length tiers (``(slots, positions)`` each, the slots summing to ``slots``):
        #: the cache as one array per tier, each stepped whole by ``decode`` at its own
        #: length; () for one cache of ``max_length`` positions.
        self.tiers = tuple((int(n), int(length)) for n, length in tiers)
        #: (tiers) The layout of the running decoder whose state ``relayout`` takes: its
        #: tiers, or () for one cache.
        self.relayout_from = tuple((int(n), int(length)) for n, length in relayout_from)
        #: Steps per decode program (``multi_step``): above 1, the plain steps (over
        #: every slot, fewer, or a window) are blocks of up to that many steps in one
        #: program, the number run an argument (1: one step, as before).
        self.multi_step = max(1, multi_step) if not in_group else 1
        #: Each prefill cell as two programs (``rows``: the prompts' cache rows and
        #: last logits, without the state; ``insert``: into the state), so that the
        #: rows can run on a thread of their own while the steps run.
        self.overlap = overlap
        self.slots, self.max_length = slots, max_length
        self.in_group = in_group
        # The sampling controls' programs (a group's followers run the step and the
        # prefills only).
        self.controls = controls and not in_group
        self.vocab = int(art.config["vocab"])
        #: Draft tokens the verify program checks per slot (0: none).
        self.speculate = speculate
        #: The smaller steps' slot counts (multiples of the devices, under ``slots``):
        #: each device steps the first ``n / devices`` of its slots.
        self.step_slots = sorted(set(step_slots) - {slots})
        #: The cache windows (positions, under ``max_length``) the steps also run over.
        self.step_lengths = sorted(set(step_lengths) - {max_length})
        #: The prefix pool's (entries, block tokens), or None.
        self.prefix = prefix
        # A prefix copy fills up to ``width`` blocks of ``load_rows`` slots at once; a
        # save writes up to ``width`` blocks (one prompt's worth).
        self.load_rows = max(rows, default=1)
        self.width = (max_length - 1) // prefix[1] if prefix else 0
        #: The ints columns of a prefill's rows: the sampling's, and with the prefix
        #: cache one per block a prompt may save (``_save_rows``: the insert writes
        #: them into the pool, no save program after it).
        self.prefill_ints = sampling.INTS + self.width
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
        self._step_jits(mesh, state_sharding)
        if prefix is not None:
            self._pool_jits(state_sharding)
        self._insert_jits(state_sharding)

    def _step_jits(self, mesh: Mesh, state_sharding: Any) -> None:
        """The steps (whole, with the sampling controls, over fewer slots, over cache
        windows), the verify step and the slot move, jitted."""
        devices, slots, in_group = self.devices, self.slots, self.in_group
        # Slots are independent: each device steps its own (shard_map), with no
        # collective; partitioned by jax instead, the step gathers the cache between
        # devices (21 all-gathers in the demo decoder's), which in a multi-host group
        # cross processes (milliseconds a step over gloo on CPU: docs/multihost.md).
        by_slot_specs = jax.tree.map(lambda _: P(BATCH_AXIS), self.shapes)

        def whole_step(full: bool) -> Any:
            # The tokens on every device (one process reads them all) and the scores left
            # by slot (read, from each device's share, only when a slot wants them). The
            # full step takes the slots' allowed tokens too (``_full_step``).
            return jax.jit(
                jax.shard_map(
                    self._full_step if full else self._step,
                    mesh=mesh,
                    in_specs=(P(), by_slot_specs, P(BATCH_AXIS)) if full else (P(), by_slot_specs),
                    out_specs=(by_slot_specs, P(BATCH_AXIS), P(BATCH_AXIS)),
                    check_vma=False,
                ),
                donate_argnums=(1,),
                out_shardings=(
                    state_sharding,
                    self.by_slot if in_group else self.replicated,
                    self.by_slot,
                ),
            )

        def part_step(n: int, window: int | None = None) -> Any:
            if self.multi_step > 1:
                return self._block_jit(mesh, state_sharding, n, window)
            return jax.jit(
                jax.shard_map(
                    functools.partial(self._step_part, rows=n // len(devices), window=window),
                    mesh=mesh,
                    in_specs=(P(), by_slot_specs),
                    out_specs=(by_slot_specs, P(BATCH_AXIS), P(BATCH_AXIS)),
                    check_vma=False,
                ),
                donate_argnums=(1,),
                out_shardings=(state_sharding, self.replicated, self.by_slot),
            )

        # The steps: without the sampling controls and scores (what runs while no busy
        # slot has either: they cost a cond each on every step), and with them.
        self._step_jit = (
            self._block_jit(mesh, state_sharding, slots) if self.multi_step > 1
            else whole_step(False)
        )  # fmt: skip
        self._full_step_jit = whole_step(True)
        self._split_jits(mesh, state_sharding)
        self._part_jits = {n: part_step(n) for n in self.step_slots}
        self._window_jits = {
            (n, w): part_step(n, w) for n in [*self.step_slots, slots] for w in self.step_lengths
        }
        self._move_jit = jax.jit(self._move, donate_argnums=(0,), out_shardings=state_sharding)
        # (tiers: the one-cache state of a running decoder into this layout; not donated,
        # its buffers are of other shapes, and freed once it has run)
        self._relayout_jit = jax.jit(self._relayout, out_shardings=state_sharding)
        self._verify_jit = jax.jit(
            jax.shard_map(
                self._verify,
                mesh=mesh,
                in_specs=(P(), by_slot_specs, P(BATCH_AXIS)),
                out_specs=(by_slot_specs, P(BATCH_AXIS), P(BATCH_AXIS)),
                check_vma=False,
            ),
            donate_argnums=(1,),
            out_shardings=(state_sharding, self.replicated, self.replicated),
        )

    def _split_jits(self, mesh: Mesh, state_sharding: Any) -> None:
        """The step with the sampling controls as two programs, jitted: ``forward``
        and ``pick`` (a structured output's: the next token's masks are computed on the
        host while the device runs the forward)."""
        by_slot_specs = jax.tree.map(lambda _: P(BATCH_AXIS), self.shapes)
        logits_spec = P(BATCH_AXIS)
        self._forward_jits = {
            window: jax.jit(
                jax.shard_map(
                    functools.partial(self._forward, window=window or None), mesh=mesh,
                    in_specs=(P(), by_slot_specs), out_specs=(by_slot_specs, logits_spec),
                    check_vma=False,
                ),
                donate_argnums=(1,),
                out_shardings=(state_sharding, self.by_slot),
            )
            for window in (0, *self.step_lengths)
        }  # fmt: skip
        self._pick_jit = jax.jit(
            jax.shard_map(
                self._pick, mesh=mesh, in_specs=(by_slot_specs, logits_spec, P(BATCH_AXIS)),
                out_specs=(by_slot_specs, P(BATCH_AXIS), P(BATCH_AXIS)), check_vma=False,
            ),
            donate_argnums=(0,),
            out_shardings=(
                state_sharding, self.by_slot if self.in_group else self.replicated, self.by_slot
            ),
        )  # fmt: skip

    def _block_jit(self, mesh: Mesh, state_sharding: Any, n: int, window: int | None = None) -> Any:
        """A plain step over ``n`` slots (and a cache ``window``) as a block of up to
        ``multi_step`` steps, jitted: ``(params, state, k) -> (state, tokens
        [multi_step, n], k)``, step i's tokens in row i."""
        by_slot_specs = jax.tree.map(lambda _: P(BATCH_AXIS), self.shapes)
        return jax.jit(
            jax.shard_map(
                functools.partial(
                    self._step_block,
                    rows=n // len(self.devices),
                    window=window,
                    steps=self.multi_step,
                ),
                mesh=mesh,
                in_specs=(P(), by_slot_specs, P()),
                out_specs=(by_slot_specs, P(None, BATCH_AXIS), P()),
                check_vma=False,
            ),
            donate_argnums=(1,),
            out_shardings=(state_sharding, self.replicated, self.replicated),
        )

    def _insert_jits(self, state_sharding: Any) -> None:
        """The prefill- and extend-inserts and the sampling controls' insert, jitted.
        With the prefix cache, a prefill's insert takes the pool after the state (both
        donated) and returns it after the state (``_save_rows``)."""
        pooled = (self.pool_sharding,) if self.prefix is not None else ()
        out = (state_sharding, *pooled, self.replicated, self.replicated)
        self._prefill_jit = jax.jit(
            self._prefill_saving if pooled else self._prefill_packed,
            donate_argnums=(1, 2) if pooled else (1,),
            out_shardings=out,
        )
        self._rows_jit = jax.jit(
            self._prefill_rows, out_shardings=(self.replicated, self.replicated)
        )
        self._insert_rows_jit = jax.jit(
            self._insert_saving if pooled else self._insert_rows,
            donate_argnums=(0, 1) if pooled else (0,),
            out_shardings=out,
        )
        self._extend_jit = jax.jit(
            self._extend_packed,
            donate_argnums=(1,),
            out_shardings=(state_sharding, self.replicated, self.replicated, self.replicated),
        )
        self._control_jit = jax.jit(
            self._control, donate_argnums=(0,), out_shardings=state_sharding
        )

    def _pool_jits(self, state_sharding: Any) -> None:
        """The prefix pool's programs (empty pool, copy into slots, save), jitted."""
        # Every leaf has a sequence axis (``_prefix_pool`` checked): its index.
        self._pool_axes = [a for a in self._length_axes if a is not None]
        self.pool_shapes = self._pool_specs()
        self.pool_sharding = jax.tree.map(lambda s: s.sharding, self.pool_shapes)
        self._pool_jit = jax.jit(self._make_pool, out_shardings=self.pool_sharding)
        self._load_jit = jax.jit(
            self._load_prefix, donate_argnums=(0,), out_shardings=state_sharding
        )
        self._save_jit = jax.jit(
            self._save_blocks, donate_argnums=(0,), out_shardings=self.pool_sharding
        )

    def place(self, params: Any) -> Any:
        """``params`` on every device."""
        return jax.device_put(params, jax.tree.map(lambda _: self.replicated, params))

    def jobs(
        self,
        lengths: Sequence[int],
        batches: Sequence[int],
        chunks: Sequence[int] = (),
        rows: Sequence[int] = (),
    ) -> list[tuple[str, int, int]]:
        """Every program of a load, in order: (what, batch, length)."""
        todo = [("state", 0, 0), ("step", 0, 0)]
        if self.controls:
            todo += [("control", 0, 0), ("step", -1, 0)]
            if not self.tiers:  # (the full step as forward and pick: one cache only)
                todo += [("forward", 0, 0), ("pick", 0, 0)]
                todo += [("forward", 0, w) for w in self.step_lengths]
        if self.speculate:
            todo.append(("verify", 0, self.speculate))
        if self.step_slots:
            todo += [("step", n, 0) for n in self.step_slots] + [("move", 0, 0)]
        todo += [("step", n, w) for n, w in self._window_jits]
        cells = [(b, n) for n in lengths for b in batches]
        if self.overlap:
            todo += [(what, b, n) for b, n in cells for what in ("rows", "insert")]
        else:
            todo += [("prefill", b, n) for b, n in cells]
        todo += [("extend", r, k) for k in chunks for r in rows]
        if self.prefix is not None:
            todo += [("pool", 0, 0), ("load", 0, 0), ("save", 0, 0)]
        return todo

    def lower(self, what: str, b: int, n: int) -> Any:
        def ints(*shape: int, dtype: Any = jnp.int32) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self.replicated)

        def floats(b: int) -> jax.ShapeDtypeStruct:
            return ints(b, sampling.FLOATS, dtype=jnp.float32)

        if what == "state":
            return self._state_jit.lower()
        if what == "step":
            step = (
                self._window_jits[(b, n)] if n
                else self._full_step_jit if b < 0
                else self._part_jits[b] if b
                else self._step_jit
            )  # fmt: skip
            if self.multi_step > 1 and b >= 0:  # (a block: how many steps it runs)
                k = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated)
                return step.lower(self.param_specs, self.shapes, k)
            if b < 0:  # (the full step: the allowed tokens)
                allowed = self.shapes["allowed"]
                return step.lower(self.param_specs, self.shapes, allowed)
            return step.lower(self.param_specs, self.shapes)
        if what == "forward":
            return self._forward_jits[n].lower(self.param_specs, self.shapes)
        if what == "pick":
            logits = jax.eval_shape(self._forward, self.param_specs, self.shapes)[1]
            logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=self.by_slot)
            return self._pick_jit.lower(self.shapes, logits, self.shapes["allowed"])
        if what == "move":
            s = self.slots
            return self._move_jit.lower(self.shapes, ints(s), ints(s))
        if what == "relayout":
            old = self.relayout_from
            cache = (
                tuple(self._cache_specs(n, length) for n, length in old) if old
                else self._cache_specs(self.slots, self.max_length)
            )  # fmt: skip
            return self._relayout_jit.lower(self.shapes | {"cache": cache}, ints(self.slots))
        if what == "verify":
            drafts = jax.ShapeDtypeStruct((self.slots, n), jnp.int32, sharding=self.by_slot)
            return self._verify_jit.lower(self.param_specs, self.shapes, drafts)
        if what == "control":
            c = sampling
            return self._control_jit.lower(
                self.shapes,
                ints(1),
                ints(1, self.max_length),
                ints(1, c.MAX_LOGIT_BIAS),
                ints(1, c.MAX_LOGIT_BIAS, dtype=jnp.float32),
                ints(1, c.MAX_BANNED),
                ints(1, grammar.words(self.vocab)),
            )
        if what == "pool":
            return self._pool_jit.lower()
        if what == "load":
            r = self.load_rows
            return self._load_jit.lower(self.shapes, self.pool_shapes, ints(r), ints(r, self.width))
        if what == "save":
            m = self.width
            return self._save_jit.lower(self.pool_shapes, self.shapes, ints(m), ints(m), ints(m))
        if what == "extend":  # (its host inputs packed: ``runner.Packed``)
            packed = ints(b, n + sampling.CHUNK_INTS + sampling.FLOATS)
            return self._extend_jit.lower(self.param_specs, self.shapes, packed)
        pool = (self.pool_shapes,) if self.prefix is not None else ()
        if what == "prefill":
            packed = ints(b, n + self.prefill_ints + sampling.FLOATS)
            return self._prefill_jit.lower(self.param_specs, self.shapes, *pool, packed)
        args = (ints(b, n), ints(b, self.prefill_ints), floats(b))
        if what == "rows":
            return self._rows_jit.lower(self.param_specs, *args[:2])
        if what == "insert":
            made = jax.eval_shape(self._prefill_rows, self.param_specs, *args[:2])
            rows, logits = jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.replicated), made
            )
            return self._insert_rows_jit.lower(self.shapes, *pool, rows, logits, *args[1:])
        raise ValueError(f"no decoder program {what!r}")

    def key(self, what: str, b: int, n: int) -> str:
        """The stored key of one program: the artifact's files, the program and its
        sizes, the devices, and this code, from which the programs are traced (with
        ``pxrt.sampling`` and the limits in ``pxrt.decoder.params``)."""
        return stored.key_of(
            {
                "decoder": self.art.manifest.get("files", {}),
                "program": [what, b, n, self.slots, self.max_length]
                + ([list(map(list, self.tiers))] if self.tiers else [])
                + ([list(map(list, self.relayout_from))] if what == "relayout" else [])
                # (a plain step's block size)
                + ([self.multi_step] if what == "step" and b >= 0 and self.multi_step > 1 else [])
                # (the pool's programs: its size, and the rows a copy takes)
                + (list(self.prefix or ()) + [self.load_rows] if what in POOL else [])
                # (a prefill's: the pool its insert saves into, and its ints' columns)
                + (list(self.prefix or ()) if what in ("prefill", "rows", "insert") else []),
                "devices": stored.device_fields(self.devices),
                "x64": self.art.x64,
            },
            code=(sys.modules[__name__], sampling, _params),
        )

    def describe(self, what: str, b: int, n: int) -> str:
        return {
            "state": "the empty state",
            "step": "the decode step"
            + (" with the sampling controls" if b < 0 else f" over {b} slots" if b else "")
            + (f" within {n} positions" if n else ""),
            "move": "the slot move",
            "relayout": "the one cache's state into the length tiers",
            "control": "the sampling controls' insert",
            "forward": "the decode step's forward (the step with the controls' first half)"
            + (f" within {n} positions" if n else ""),
            "pick": "the decode step's sampling with the controls and masks",
            "verify": f"the draft verification of {n} tokens",
            "pool": "the empty prefix pool",
            "load": "the prefix copy",
            "save": "the prefix save",
            "rows": f"the prefill (its rows) {b} x {n}",
            "insert": f"the prefill's insert {b} x {n}",
        }.get(what, f"{what} {b} x {n}")

    # The traced programs.

    def _cache_specs(self, slots: int, length: int) -> Any:
        return jax.tree.unflatten(
            self._cache_tree,
            [
                jax.ShapeDtypeStruct(
                    (slots,) + s.at({LENGTH_DIM: length}), s.dtype, sharding=self.by_slot
                )
                for s in self._specs
            ],
        )

    def _state_specs(self) -> dict:
        if self.tiers:  # (a tuple of caches, one per tier)
            cache: Any = tuple(self._cache_specs(n, length) for n, length in self.tiers)
        else:
            cache = self._cache_specs(self.slots, self.max_length)
        # Per slot: int32 (next input token, its position, top-k, seed bits, whether it
        # wants scores, whether its controls apply, the end of its stop ids' ban) and
        # float32 (temperature, top-p, penalties): two arrays, so that an insert is two
        # small scatters; then the controls' rows (``sampling.CONTROL_ROWS``), written
        # (by ``control``) only for a request that has controls.
        c = sampling

        def per_slot(*shape: int, dtype: Any = jnp.int32) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct((self.slots, *shape), dtype, sharding=self.by_slot)

        return {
            "cache": cache,
            "ints": per_slot(c.INTS),
            "floats": per_slot(c.FLOATS, dtype=jnp.float32),
            "counts": per_slot(self.vocab),
            "prompted": per_slot(self.vocab, dtype=jnp.bool_),
            "bias_ids": per_slot(c.MAX_LOGIT_BIAS),
            "bias": per_slot(c.MAX_LOGIT_BIAS, dtype=jnp.float32),
            "banned": per_slot(c.MAX_BANNED),
            "allowed": per_slot(grammar.words(self.vocab)),
        }

    def _make_state(self) -> dict:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.shapes)

    def _choose(
        self,
        logits: jax.Array,
        ints: jax.Array,
        floats: jax.Array,
        position: jax.Array,
        state: dict,
        index: jax.Array | None,
        cols: tuple[int, int, int, int, int],
        full: bool = True,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Each row's next token at ``position``: its controls applied to ``logits``
        (the state's control rows ``index``, or all), then sampled; with its scores
        (zeros unless a row wants them) and whether its controls apply. ``cols``: the
        columns of ``ints`` with top-k, the seed bits, and WANT, CTRL, UNTIL.
        ``full`` False: neither controls nor scores (zeros), whatever the rows say."""
        top_k, seed_bits, want, ctrl, until = (ints[:, i] for i in cols)
        on = (ctrl > 0) & full
        seed = lax.bitcast_convert_type(seed_bits, jnp.uint32)
        logits = logits.astype(jnp.float32)
        temperature, top_p = floats[:, sampling.TEMP], floats[:, sampling.TOPP]
        if not full:
            tokens = sample(logits, temperature, top_k, top_p, seed, position)
            width = 1 + 2 * sampling.top_count(logits.shape[-1])
            return tokens, jnp.zeros((logits.shape[0], width), jnp.float32), on
        adjusted = sampling.controls(logits, ctrl, state, index, floats, position, until)
        tokens = sample(adjusted, temperature, top_k, top_p, seed, position)
        return tokens, sampling.maybe_scores(logits, tokens, want), on

    def _step(
        self, params: Any, state: dict, full: bool = False, length: int | None = None
    ) -> tuple[dict, jax.Array, jax.Array]:
        c = sampling
        ints, floats = state["ints"], state["floats"]
        if self.tiers:
            cache, logits, positions = self._tiered_decode(params, state["cache"], ints)
        else:
            positions = jnp.minimum(ints[:, c.POS], (length or self.max_length) - 1)
            cache, logits = self.art.decode.call(params, state["cache"], ints[:, c.TOK], positions)
        following = positions + 1
        cols = (c.TOPK, c.SEED, c.WANT, c.CTRL, c.UNTIL)
        tokens, scores, on = self._choose(logits, ints, floats, following, state, None, cols, full)
        ints = ints.at[:, c.TOK].set(tokens).at[:, c.POS].set(following)
        state = state | {"cache": cache, "ints": ints}
        if full:  # (the generated tokens' counts, for the penalties)
            rows = jnp.arange(tokens.shape[0])
            state["counts"] = state["counts"].at[rows, tokens].add(on.astype(jnp.int32))
        return state, tokens, scores

    def _tiered_decode(
        self, params: Any, caches: tuple, ints: jax.Array
    ) -> tuple[tuple, jax.Array, jax.Array]:
        """``decode`` over each tier's cache (this device's rows of it), each at its own
        length: (the caches, the logits and the positions written, in slot order). This
        device's slots are its rows of each tier, tier after tier."""
        n_dev = len(self.devices)
        out, logits, written, at = [], [], [], 0
        for (n, length), cache in zip(self.tiers, caches):
            rows = ints[at : at + n // n_dev]
            at += n // n_dev
            positions = jnp.minimum(rows[:, sampling.POS], length - 1)
            cache, got = self.art.decode.call(params, cache, rows[:, sampling.TOK], positions)
            out.append(cache)
            logits.append(got)
            written.append(positions)
        return tuple(out), jnp.concatenate(logits), jnp.concatenate(written)

    def tier_rows(self, slot: jax.Array, tiers: Sequence | None = None) -> list[jax.Array]:
        """Each tier's row of each (global) ``slot``, or the tier's size where the slot
        is not in that tier (out of range: a scatter drops it). ``tiers``: another
        layout's (a relayout's source), else this one's."""
        n_dev = len(self.devices)
        per = self.slots // n_dev
        device, local = slot // per, slot % per
        rows, start = [], 0
        for n, _ in self.tiers if tiers is None else tiers:
            share = n // n_dev
            inside = (local >= start) & (local < start + share) & (slot >= 0)
            rows.append(jnp.where(inside, device * share + local - start, n))
            start += share
        return rows

    def _full_step(
        self, params: Any, state: dict, allowed: jax.Array
    ) -> tuple[dict, jax.Array, jax.Array]:
        """The step with the sampling controls and scores, each slot's next token one
        its ``allowed`` bits leave (a structured output's grammar; all set without one,
        and only where its controls apply). The state's own bits are left as they are:
        a slot being filled takes its first token's from there."""
        kept = state["allowed"]
        state, tokens, scores = self._step(params, state | {"allowed": allowed}, full=True)
        return state | {"allowed": kept}, tokens, scores

    def _forward(
        self, params: Any, state: dict, window: int | None = None
    ) -> tuple[dict, jax.Array]:
        """The full step's first half: every slot's next input token through the
        model at its position (its cache written there), the logits returned; nothing
        else of the state changes (run again, it writes the same). With a ``window``,
        over the first ``window`` positions of the cache (as ``_step_part``): a slot at
        or past it (an idle one) gets logits of nothing and writes nothing."""
        ints = state["ints"]
        tokens = ints[:, sampling.TOK]
        if not window:
            positions = jnp.minimum(ints[:, sampling.POS], self.max_length - 1)
            cache, logits = self.art.decode.call(params, state["cache"], tokens, positions)
            return state | {"cache": cache}, logits
        part = self._part(state, ints.shape[0], window)
        positions = jnp.minimum(ints[:, sampling.POS], window - 1)
        cache, logits = self.art.decode.call(params, part["cache"], tokens, positions)
        inside = ints[:, sampling.POS] < window
        cache = self._written(state["cache"], cache, positions, inside, window)
        return state | {"cache": cache}, logits

    def _pick(
        self, state: dict, logits: jax.Array, allowed: jax.Array
    ) -> tuple[dict, jax.Array, jax.Array]:
        """The full step's second half: each slot's next token from ``logits`` (a
        ``_forward``'s), its controls and its ``allowed`` bits applied (as
        ``_full_step``). A row of no allowed token is held: its slot changed since the
        forward, or it has no token to take; nothing of it changes."""
        c = sampling
        ints, floats = state["ints"], state["floats"]
        active = jnp.any(allowed != 0, axis=-1)
        following = jnp.minimum(ints[:, c.POS], self.max_length - 1) + 1
        cols = (c.TOPK, c.SEED, c.WANT, c.CTRL, c.UNTIL)
        seen = state | {"allowed": allowed}
        tokens, scores, on = self._choose(logits, ints, floats, following, seen, None, cols)
        stepped = ints.at[:, c.TOK].set(tokens).at[:, c.POS].set(following)
        rows = jnp.arange(tokens.shape[0])
        counts = state["counts"].at[rows, tokens].add((on & active).astype(jnp.int32))
        ints = jnp.where(active[:, None], stepped, ints)
        return state | {"ints": ints, "counts": counts}, tokens, scores

    def _part(self, state: dict, rows: int, window: int | None) -> dict:
        """What a step over this device's first ``rows`` slots reads of ``state``: their
        ints, floats and cache (with a ``window``, its first ``window`` positions)."""
        length = window or self.max_length
        part = {k: jax.tree.map(lambda a: a[:rows], state[k]) for k in ("ints", "floats")}
        part["cache"] = jax.tree.unflatten(
            self._cache_tree,
            [
                lax.slice_in_dim(a[:rows], 0, length, axis=axis)
                if window and axis is not None else a[:rows]
                for a, axis in zip(jax.tree.leaves(state["cache"]), self._length_axes)
            ],
        )  # fmt: skip
        return part

    def _step_part(
        self, params: Any, state: dict, rows: int, window: int | None = None
    ) -> tuple[dict, jax.Array, jax.Array]:
        """The step over this device's first ``rows`` slots (the busy ones are kept
        there), and with a ``window`` over the first ``window`` positions of their cache
        only (every busy slot's position is under it); the others are left as they are.
        Only what the plain step reads is taken out, and of the cache only the entries
        the step wrote go back: each slot's at its position (decode writes nothing
        else), or the whole rows of a leaf without a sequence axis. A slot at or past
        the window (an idle one, parked at the cache's end) is stepped on a clamped
        position and nothing of it goes back."""
        c = sampling
        length = window or self.max_length
        part = self._part(state, rows, window)
        before = part["ints"]
        written = jnp.minimum(before[:, c.POS], length - 1)
        part, tokens, scores = self._step(params, part, length=length)
        inside = before[:, c.POS] < length
        cache = self._written(state["cache"], part["cache"], written, inside, window)
        ints = part["ints"] if not window else jnp.where(inside[:, None], part["ints"], before)
        ints = lax.dynamic_update_slice_in_dim(state["ints"], ints, 0, axis=0)
        return state | {"cache": cache, "ints": ints}, tokens, scores

    def _written(
        self, cache: Any, part: Any, written: jax.Array, inside: jax.Array, window: int | None
    ) -> Any:
        """``cache`` with what one decode over its first rows (``part``, over their
        first ``window`` positions, or all) wrote: each row's entry at ``written[r]``
        (decode writes nothing else; with a window, only where ``inside``), or the whole
        rows of a leaf without a sequence axis."""
        at = jnp.arange(written.shape[0])
        leaves = []
        for old, new, axis in zip(jax.tree.leaves(cache), jax.tree.leaves(part), self._length_axes):
            if axis is None:
                leaves.append(lax.dynamic_update_slice_in_dim(old, new, 0, axis=0))
            elif window:
                # (a slot past the window goes to a position out of range: dropped)
                dst = jnp.where(inside, written, self.max_length)
                rest = (slice(None),) * (axis - 1)
                got = new[(at,) + rest + (written,)]
                leaves.append(old.at[(at,) + rest + (dst,)].set(got, mode="drop"))
            else:
                where = (at,) + (slice(None),) * (axis - 1) + (written,)
                leaves.append(
                    old.at[where].set(new[where], indices_are_sorted=True, unique_indices=True)
                )
        return jax.tree.unflatten(self._cache_tree, leaves)

    def _step_block(
        self,
        params: Any,
        state: dict,
        k: jax.Array,
        rows: int,
        window: int | None,
        steps: int,
    ) -> tuple[dict, jax.Array, jax.Array]:
        """``k`` plain steps (at most ``steps``) in one program, over this device's
        first ``rows`` slots and with a ``window`` over the first ``window`` positions of
        their cache (as ``_step_part``); returns the state, the tokens ``[steps, rows]``
        (step i's in row i, zeros past ``k``) and ``k``. Over every slot and the whole
        cache the steps run on the state itself; otherwise on the part taken out once,
        and of the cache only the ``k`` entries each slot's steps wrote go back (a slot
        at or past the window: none). Each step is the plain one, so the tokens are the
        single steps' (seeded sampling folds in the position)."""
        c = sampling
        whole = rows == self.slots // len(self.devices) and not window

        def run(part: dict, length: int | None) -> tuple[dict, jax.Array]:
            def body(i: jax.Array, carry: tuple[dict, jax.Array]) -> tuple[dict, jax.Array]:
                st, buf = carry
                st, tokens, _ = self._step(params, st, length=length)
                return st, lax.dynamic_update_index_in_dim(buf, tokens, i, 0)

            buf = jnp.zeros((steps, rows), jnp.int32)
            return lax.fori_loop(0, k, body, (part, buf))

        if whole:
            state, buf = run(state, None)
            return state, buf, k
        length = window or self.max_length
        part = self._part(state, rows, window)
        before = part["ints"]
        part, buf = run(part, length)
        # The entries the steps wrote: positions start..start+k-1 of each slot inside.
        at = jnp.arange(rows)[:, None]
        j = jnp.arange(steps)[None, :]
        pos = jnp.minimum(before[:, c.POS], length - 1)[:, None] + j
        inside = before[:, c.POS] < length
        keep = inside[:, None] & (j < k) & (pos < length)
        src, dst = jnp.minimum(pos, length - 1), jnp.where(keep, pos, self.max_length)
        leaves = []
        for old, new, axis in zip(
            jax.tree.leaves(state["cache"]), jax.tree.leaves(part["cache"]), self._length_axes
        ):
            if axis is None:
                leaves.append(lax.dynamic_update_slice_in_dim(old, new, 0, axis=0))
                continue
            rest = (slice(None),) * (axis - 1)
            got = new[(at,) + rest + (src,)]
            leaves.append(old.at[(at,) + rest + (dst,)].set(got, mode="drop"))
        ints = jnp.where(inside[:, None], part["ints"], before) if window else part["ints"]
        ints = lax.dynamic_update_slice_in_dim(state["ints"], ints, 0, axis=0)
        state = state | {"cache": jax.tree.unflatten(self._cache_tree, leaves), "ints": ints}
        return state, buf, k

    def _verify(
        self, params: Any, state: dict, drafts: jax.Array
    ) -> tuple[dict, jax.Array, jax.Array]:
        """Speculative decoding's step, greedy: each slot's next input token and its
        ``k`` drafts (-1: none) through ``extend`` at the slot's position; the greedy
        token after each; the drafts accepted (those equal to the greedy token before
        them, up to the first that is not). Returns the state (next input token: the
        greedy one after the last accepted draft), the greedy tokens ``[slots, k + 1]``
        (the first ``accepted + 1`` of a slot are its new tokens) and ``accepted``. The
        rows written past the accepted drafts are rewritten by the steps that reach
        those positions before anything reads them."""
        c = sampling
        ints = state["ints"]
        k = drafts.shape[1]
        # (a busy slot has room for k more; another's rows are not read)
        start = jnp.minimum(ints[:, c.POS], self.max_length - 1 - k)
        tokens = jnp.concatenate([ints[:, c.TOK][:, None], jnp.maximum(drafts, 0)], axis=1)
        cache, logits = self.art.extend_for(*tokens.shape).call(
            params, state["cache"], tokens, start
        )
        greedy = sampling.greedy(logits)
        agree = (greedy[:, :k] == drafts).astype(jnp.int32)
        accepted = jnp.cumprod(agree, axis=1).sum(axis=1)
        last = jnp.take_along_axis(greedy, accepted[:, None], axis=1)[:, 0]
        ints = ints.at[:, c.TOK].set(last).at[:, c.POS].set(start + accepted + 1)
        return state | {"cache": cache, "ints": ints}, greedy, accepted

    def _control(
        self,
        state: dict,
        slot: jax.Array,
        prompt: jax.Array,
        bias_ids: jax.Array,
        bias: jax.Array,
        banned: jax.Array,
        allowed: jax.Array,
    ) -> dict:
        """Slot ``slot[r]``'s control rows, before its prompt is inserted: no token
        generated yet, the prompt's tokens (``prompt[r]``, padded with ids out of
        range), the logit bias, the ids ``min_tokens`` bans (the same padding) and the
        tokens its first may be (a structured output's; all bits set without one)."""
        at = jnp.arange(slot.shape[0])[:, None]
        prompted = jnp.zeros((slot.shape[0], self.vocab), jnp.bool_)
        prompted = prompted.at[at, prompt].set(True, mode="drop")
        rows = {"counts": 0, "prompted": prompted, "bias_ids": bias_ids, "bias": bias,
                "banned": banned, "allowed": allowed}  # fmt: skip
        # Until its prompt's last chunk (or its prefill) sets them, the slot neither
        # counts the tokens the steps compute for it nor wants their scores.
        ints = state["ints"].at[slot, sampling.WANT].set(0, mode="drop")
        ints = ints.at[slot, sampling.CTRL].set(0, mode="drop")
        return (
            state
            | {k: state[k].at[slot].set(v, mode="drop") for k, v in rows.items()}
            | {"ints": ints}
        )

    def tier_slots(self) -> list[np.ndarray]:
        """Each tier's rows' (global) slots, in row order: the slots of its length
        (one tier per length), lowest first, as ``relayout.slot_lengths`` numbers them
        (``tier_rows`` the other way)."""
        lengths = np.array(slot_lengths(self.tiers, len(self.devices)))
        return [np.flatnonzero(lengths == length) for _, length in self.tiers]

    def _relayout(self, old: dict, src: jax.Array) -> dict:
        """The state in tiers from a running decoder's state ``old`` (one cache, or the
        tiers ``relayout_from``): slot ``i`` takes old slot ``src[i]``'s cache rows, cut
        or padded to its tier's length (a slot moved holds no more than its new tier),
        and its per-slot rows; a ``src`` out of range leaves slot ``i`` empty (zeros)."""
        valid = (src >= 0) & (src < self.slots)
        taken = jnp.clip(src, 0, self.slots - 1)
        caches = []
        for at, (_, length) in zip(self.tier_slots(), self.tiers):
            take = lambda cache, rows, _, length=length: self._rows_at(cache, rows, length)  # noqa: E731
            leaves = self._from_slots(old["cache"], taken[at], take, self.relayout_from)
            keep = valid[at]
            leaves = [_where_rows(keep, g, jnp.zeros_like(g)) for g in leaves]
            caches.append(jax.tree.unflatten(self._cache_tree, leaves))
        state = {
            key: _where_rows(valid, rows[taken], jnp.zeros_like(rows))
            for key, rows in old.items()
            if key != "cache"
        }
        return state | {"cache": tuple(caches)}

    def _move(self, state: dict, src: jax.Array, dst: jax.Array) -> dict:
        """Slot ``dst[i]`` := slot ``src[i]`` (its cache rows and per-slot state); a
        ``dst`` out of range is padding."""
        taken = jnp.clip(src, 0, self.slots - 1)
        return jax.tree.map(lambda a: a.at[dst].set(a[taken], mode="drop"), state)

    def _prefill_packed(
        self, params: Any, state: dict, packed: jax.Array
    ) -> tuple[dict, jax.Array, jax.Array]:
        """``_prefill_insert`` with its host inputs in one array (``runner.Packed``)."""
        return self._prefill_insert(params, state, *unpacked(packed, sampling.INTS))

    def _extend_packed(
        self, params: Any, state: dict, packed: jax.Array
    ) -> tuple[dict, jax.Array, jax.Array, jax.Array]:
        """``_extend_insert`` with its host inputs in one array (``runner.Packed``)."""
        return self._extend_insert(params, state, *unpacked(packed, sampling.CHUNK_INTS))

    def _prefill_insert(
        self, params: Any, state: dict, tokens: jax.Array, ints: jax.Array, floats: jax.Array
    ) -> tuple[dict, jax.Array, jax.Array]:
        rows, logits = self._prefill_rows(params, tokens, ints)
        return self._insert_rows(state, rows, logits, ints, floats)

    def _prefill_saving(
        self, params: Any, state: dict, pool: Any, packed: jax.Array
    ) -> tuple[dict, Any, jax.Array, jax.Array]:
        """``_prefill_packed`` that also saves its prompts' blocks (``_insert_saving``)."""
        tokens, ints, floats = unpacked(packed, self.prefill_ints)
        rows, logits = self._prefill_rows(params, tokens, ints)
        return self._insert_saving(state, pool, rows, logits, ints, floats)

    def _insert_saving(
        self,
        state: dict,
        pool: Any,
        rows: Any,
        logits: jax.Array,
        ints: jax.Array,
        floats: jax.Array,
    ) -> tuple[dict, Any, jax.Array, jax.Array]:
        """``_insert_rows``, the prompts' blocks also written into the prefix ``pool``
        where the ints' columns past the sampling's name an entry (``_save_rows``)."""
        state, first, scores = self._insert_rows(
            state, rows, logits, ints[:, : sampling.INTS], floats
        )
        return state, self._save_rows(pool, rows, ints[:, sampling.INTS :]), first, scores

    def _prefill_rows(
        self, params: Any, tokens: jax.Array, ints: jax.Array
    ) -> tuple[Any, jax.Array]:
        """The prompts' cache rows and their last positions' logits: the prefill alone,
        which reads nothing of the state."""
        return self.art.prefill_for(*tokens.shape).call(params, tokens, ints[:, sampling.LEN])

    def _insert_rows(
        self, state: dict, rows: Any, logits: jax.Array, ints: jax.Array, floats: jax.Array
    ) -> tuple[dict, jax.Array, jax.Array]:
        """Prefilled prompts into their slots: each one's first token sampled from
        ``logits`` (its controls applied), its ``rows`` written at the cache's start."""
        c = sampling
        lengths, slot = ints[:, c.LEN], ints[:, c.SLOT]
        taken = jnp.clip(slot, 0, self.slots - 1)  # a padding row's is dropped below
        first, scores, on = self._choose(
            logits, ints, floats, lengths, state, taken, (c.TOPK, c.SEED, c.WANT, c.CTRL, c.UNTIL)
        )
        cache = self._put_rows(state["cache"], rows, slot)
        rows_ints = ints.at[:, sampling.TOK].set(first).at[:, sampling.POS].set(lengths)
        return self._inserted(state, slot, cache, rows_ints, floats, first, on), first, scores

    def _put_rows(self, cache: Any, rows: Any, slot: jax.Array) -> Any:
        """``cache`` (the state's: one array, or a tuple of tiers) with ``rows`` written at
        its start in rows ``slot`` (out of range: dropped): with length tiers, into each
        slot's tier, cut to its length (what a slot holds is shorter than its tier)."""
        if not self.tiers:
            return self._write_rows(cache, rows, slot, self.max_length)
        return tuple(
            self._write_rows(tier, rows, at, length)
            for tier, at, (_, length) in zip(cache, self.tier_rows(slot), self.tiers)
        )

    def _write_rows(self, cache: Any, rows: Any, slot: jax.Array, length: int) -> Any:
        """``cache`` with prefilled ``rows`` written at its start in rows ``slot`` (out of
        range: dropped), cut to the cache's ``length`` positions (a prompt in a shorter
        tier is no longer than it: the positions cut are padding)."""
        return jax.tree.unflatten(
            self._cache_tree,
            [
                leaf.at[
                    (slot,)
                    if axis is None
                    else (slot,) + (slice(None),) * (axis - 1) + (slice(0, r.shape[axis]),)
                ].set(r, mode="drop")
                for leaf, r, axis in zip(
                    jax.tree.leaves(cache),
                    [
                        r if axis is None or r.shape[axis] <= length
                        else lax.slice_in_dim(r, 0, length, axis=axis)
                        for r, axis in zip(jax.tree.leaves(rows), self._length_axes)
                    ],
                    self._length_axes,
                )
            ],
        )  # fmt: skip

    def _extend_insert(
        self, params: Any, state: dict, tokens: jax.Array, ints: jax.Array, floats: jax.Array
    ) -> tuple[dict, jax.Array, jax.Array, jax.Array]:
        """A chunk of a prompt per row, into its slot: the slot's rows are taken out of
        the cache, extended by ``tokens`` at ``CHUNK_START``, and written back. A
        chunk that ends its prompt samples the first token at the prompt's end and
        makes the slot a decode slot; any other leaves it parked at the last
        position, where the steps that run meanwhile write nothing that is read.
        Returns the state, the first tokens, their scores, and the scores of each
        position's next prompt token where a row wants them (``CHUNK_PROMPT``)."""
        c = sampling
        start, count, slot = ints[:, c.CHUNK_START], ints[:, c.CHUNK_COUNT], ints[:, c.CHUNK_SLOT]
        final = ints[:, c.CHUNK_FINAL] > 0
        taken = jnp.clip(slot, 0, self.slots - 1)  # a padding row's is dropped below
        rows = self._slot_rows(state["cache"], slot)
        rows, logits = self.art.extend_for(*tokens.shape).call(params, rows, tokens, start)
        following_tokens = jnp.concatenate([tokens[:, 1:], ints[:, c.CHUNK_NEXT, None]], axis=1)
        prompted = sampling.prompt_scores(logits, following_tokens, ints[:, c.CHUNK_PROMPT])
        last = jnp.take_along_axis(logits, (count - 1)[:, None, None], axis=1)[:, 0]
        following = start + count
        # Only the chunk that ends its prompt samples: the others' scores and controls
        # are off (their first token is not read).
        chosen = ints.at[:, c.CHUNK_WANT].mul(final).at[:, c.CHUNK_CTRL].mul(final)
        cols = (c.CHUNK_TOPK, c.CHUNK_SEED, c.CHUNK_WANT, c.CHUNK_CTRL, c.CHUNK_UNTIL)
        first, scores, on = self._choose(last, chosen, floats, following, state, taken, cols)
        cache = self._put_rows(state["cache"], rows, slot)
        parked = jnp.full_like(start, self.max_length - 1)
        rows_ints = jnp.stack(
            [jnp.where(final, first, 0), jnp.where(final, following, parked)]
            + [chosen[:, i] for i in cols],
            axis=1,
        )
        state = self._inserted(state, slot, cache, rows_ints, floats, first, on)
        return state, first, scores, prompted

    def _slot_rows(self, cache: Any, slot: jax.Array) -> Any:
        """The cache rows of each (global) ``slot``, ``max_length`` positions long: with
        length tiers, each slot's from its tier, the positions past the tier's length
        zeros (a prompt in a tier is shorter than it: nothing there is read). A padding
        row's (out of range) are some slot's."""
        rows = lambda cache, at, _: self._rows_at(cache, at, self.max_length)  # noqa: E731

        return jax.tree.unflatten(self._cache_tree, self._from_slots(cache, slot, rows))

    def _rows_at(self, cache: Any, at: jax.Array, length: int) -> list:
        """Per leaf of ``cache`` (one array or tier), its rows ``at``, cut or padded with
        zeros to ``length`` positions."""
        out = []
        for leaf, axis in zip(jax.tree.leaves(cache), self._length_axes):
            got = leaf[at]
            if axis is not None and got.shape[axis] > length:
                got = lax.slice_in_dim(got, 0, length, axis=axis)
            elif axis is not None and got.shape[axis] < length:
                widths = [(0, 0)] * got.ndim
                widths[axis] = (0, length - got.shape[axis])
                got = jnp.pad(got, widths)
            out.append(got)
        return out

    def _from_slots(
        self, cache: Any, slot: jax.Array, take: Any, tiers: Sequence | None = None
    ) -> list:
        """``take(cache, rows, length)`` (a list of per-leaf arrays, a row each) for each
        (global) ``slot`` (clipped into range): with length tiers, each slot's from its
        own tier, ``take`` called per tier on the tier's rows. ``tiers``: the layout of
        ``cache`` (a relayout's source), else this one's."""
        taken = jnp.clip(slot, 0, self.slots - 1)
        tiers = self.tiers if tiers is None else tiers
        if not tiers:
            return take(cache, taken, self.max_length)
        got: list = []
        for tier, at, (n, length) in zip(cache, self.tier_rows(taken, tiers), tiers):
            part = take(tier, jnp.clip(at, 0, n - 1), length)
            got = part if not got else [_where_rows(at < n, p, g) for p, g in zip(part, got)]
        return got

    @staticmethod
    def _inserted(
        state: dict,
        slot: jax.Array,
        cache: Any,
        ints: jax.Array,
        floats: jax.Array,
        first: jax.Array,
        on: jax.Array,
    ) -> dict:
        """The state with prompts inserted into ``slot`` (out of range: dropped): the
        cache written, the rows' per-slot ints and floats, and their first token
        counted where their controls apply."""
        return state | {
            "cache": cache,
            "ints": state["ints"].at[slot].set(ints, mode="drop"),
            "floats": state["floats"].at[slot].set(floats, mode="drop"),
            "counts": state["counts"].at[slot, first].add(on.astype(jnp.int32), mode="drop"),
        }

    # The prefix pool: per cache leaf, ``entries`` blocks of the per-slot shape with
    # ``block`` positions on the sequence axis.

    def _pool_specs(self) -> Any:
        assert self.prefix is not None
        entries, block = self.prefix
        return jax.tree.unflatten(
            self._cache_tree,
            [
                jax.ShapeDtypeStruct(
                    (entries,) + s.at({LENGTH_DIM: block}), s.dtype, sharding=self.replicated
                )
                for s in self._specs
            ],
        )

    def _make_pool(self) -> Any:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.pool_shapes)

    def _load_prefix(self, state: dict, pool: Any, slots: jax.Array, ids: jax.Array) -> dict:
        """Copy pool entries ``ids[r]`` (``width`` blocks) into the start of slot
        ``slots[r]`` and park the slot; entries past a prompt's hit are padding whose
        rows land where the prompt's rest and the steps write before anything reads."""
        width = ids.shape[1]
        starts = []
        for blocks, axis in zip(jax.tree.leaves(pool), self._pool_axes):
            got = blocks[ids]  # [rows, width, *per-slot shape with the block's length]
            got = jnp.moveaxis(got, 1, axis)  # the width next to the sequence axis
            shape = got.shape[:axis] + (width * got.shape[axis + 1],) + got.shape[axis + 2 :]
            starts.append(got.reshape(shape))
        cache = self._put_rows(state["cache"], jax.tree.unflatten(self._cache_tree, starts), slots)
        ints = state["ints"].at[slots, sampling.POS].set(self.max_length - 1, mode="drop")
        return state | {"cache": cache, "ints": ints}

    def _save_blocks(
        self, pool: Any, state: dict, slots: jax.Array, blocks: jax.Array, ids: jax.Array
    ) -> Any:
        """Pool entry ``ids[m]`` := block ``blocks[m]`` of slot ``slots[m]`` (an entry
        out of range: padding, dropped)."""
        assert self.prefix is not None
        size = self.prefix[1]
        # (with tiers, each slot's from its tier: a saved block is inside the tier's length)
        got = self._from_slots(
            state["cache"], slots, lambda cache, rows, _: self._blocks_of(cache, rows, blocks, size)
        )
        leaves = [
            entries.at[ids].set(g, mode="drop") for entries, g in zip(jax.tree.leaves(pool), got)
        ]
        return jax.tree.unflatten(self._cache_tree, leaves)

    def _save_rows(self, pool: Any, rows: Any, saves: jax.Array) -> Any:
        """Pool entry ``saves[r, i] - 1`` := block ``i`` of prefilled row ``r`` (0: no
        save): what a save program copies out of the slots after an insert, written
        from the prefill's own rows by the insert (one program less per prompt)."""
        assert self.prefix is not None
        entries, size = self.prefix
        leaves = []
        for blocks, r, axis in zip(jax.tree.leaves(pool), jax.tree.leaves(rows), self._pool_axes):
            n = min(r.shape[axis] // size, saves.shape[1])
            if n == 0:  # (rows shorter than a block: nothing to save)
                leaves.append(blocks)
                continue
            r = lax.slice_in_dim(r, 0, n * size, axis=axis)
            r = r.reshape(r.shape[:axis] + (n, size) + r.shape[axis + 1 :])
            r = jnp.moveaxis(r, axis, 1)  # [rows, n, *per-slot shape with the block's length]
            r = r.reshape((-1,) + r.shape[2:])
            ids = jnp.where(saves[:, :n] > 0, saves[:, :n] - 1, entries).reshape(-1)
            leaves.append(blocks.at[ids].set(r.astype(blocks.dtype), mode="drop"))
        return jax.tree.unflatten(self._cache_tree, leaves)

    def _blocks_of(self, cache: Any, rows: jax.Array, blocks: jax.Array, size: int) -> list:
        """Per cache leaf, block ``blocks[m]`` (``size`` positions) of row ``rows[m]``."""
        got = []
        for leaf, axis in zip(jax.tree.leaves(cache), self._pool_axes):
            shape = (1,) + leaf.shape[1:axis] + (size,) + leaf.shape[axis + 1 :]

            def one(s: jax.Array, b: jax.Array, leaf: jax.Array = leaf, axis: int = axis,
                    shape: tuple = shape) -> jax.Array:  # fmt: skip
                start = [s] + [0] * (leaf.ndim - 1)
                start[axis] = b * size
                return lax.dynamic_slice(leaf, start, shape)[0]

            got.append(jax.vmap(one)(rows, blocks))
        return got
