"""Generation: pxrt vs JetStream 0.2.2's orchestrator, same model, same workload.

One decoder (``benchmarks/decoder_shapes.py``: ``pxrt.demo``'s, a parametrized one of
any size and cache layout, or keras-hub's Llama; the same params and the same functions)
served two ways in one process, greedy decoding:

- pxrt: the model exported once (``decoder_shapes.Model.export``: prefill lengths the
  powers of two from 16 to the longest prompt's, prefill batches 1 and 4) and loaded at
  ``--slots`` slots with every other load option at its default; ``Decoder.agenerate``;
- JetStream: ``google-jetstream==0.2.2``'s ``Driver`` + ``LLMOrchestrator`` driven in
  process (``Decode`` called directly, no gRPC server), over an ``Engine`` written here
  the way JetStream's own engines are: ``max_concurrent_decodes = --slots``, one jitted
  prefill per bucket (the same prefill lengths: JetStream's buckets up to
  ``max_prefill_length``), a jitted ``insert`` and ``generate`` that donate the decode
  state (KV cache and per-slot vectors), greedy sampling on device, all compiled and
  warmed before timing. The engine calls the functions pxrt exported (for keras-hub's
  Llama, those ``pxrt.adapters.keras_hub.export_causal_lm`` traced). Interleaved mode
  (prefill and generate on the same engine and device). Token ids in and out.

The workload (``decoder_shapes.workload``): ``--requests`` requests (default 8 per slot,
at least 128; ``--quick`` 2 per slot, at least 32: the same first requests at every slot
count), prompt and output lengths from ``--prompts`` and ``--outputs`` (lognormal by
default, Pareto as an option), a closed loop of ``--callers`` callers (default: one per
slot), measured as ``benchmarks/generation.py`` measures (output tokens/s, time to
first token and inter-token latency p50/p99). The runs alternate, ``--repeats`` times;
the table shows medians and the pxrt/JetStream ratios. Before that, a correctness check:
the first ``--check`` prompts through both, token for token. For keras-hub's Llama,
keras-hub's own ``generate()`` too, on length-sorted batches of ``--slots`` of the same
prompts (``decoder_shapes.keras_generate``), a run in each round alternated with the
others (the median), its first checked token for token against pxrt's.

Needs the side venv (``bash benchmarks/jetstream_env.sh``):

    .venv-jetstream/bin/python benchmarks/jetstream_compare.py \\
        [--shape demo|js-small|js-wide|keras-llama] [--layers N] [--d-model N] \\
        [--heads N] [--mlp N] [--max-length N] [--vocab N] [--layout array|layers] \\
        [--positions learned|sinusoid] [--prompts lognormal:48:8:256] \\
        [--outputs lognormal:24:8:128] [--requests N] [--slots 32] [--callers N] \\
        [--repeats 3] [--quick] [--load KEY=VALUE] [--tiers 0.25:10,0.5:5,1:1]
    .venv-jetstream/bin/python benchmarks/jetstream_compare.py --sweep [--quick]

``--tiers``: pxrt loaded with ``length_tiers`` sized for each slot count (each tier's
length a fraction of ``max_length``, its share of the slots a weight); ``--tiers
learned``: sized by the traffic (``Decoder.suggested_length_tiers`` after a one-cache
decoder served the workload, untimed); ``--tiers auto``: ``length_tiers="auto"`` at
every slot count (the default does so from 16 slots on CPU devices); ``--tiers off``:
one cache. A decoder that learns its tiers serves the workload untimed until it has
switched into them and served a run more without switching again (``generation.settle``).

``--sweep``: demo, js-small, js-wide and keras-llama at 8, 16, 32 and 64 slots (callers =
slots; ``--shapes``, ``--slots`` to change them), then one table. ``--quick``: fewer
requests and one repeat (a smoke test, not a measurement). Loading compiles, untimed:
pxrt some 25 programs per slot count (kept in its persistent compilation cache, so a
first sweep spends minutes of it on 2 cores and a second seconds), JetStream its own
dozen (each time). The old default workload:
``--shape demo --prompts pareto:4:64 --outputs pareto:8:192 --requests 1024 --callers 64``.

Aligning JetStream 0.2.2 with pxrt (see the report at the end of a run):

- JetStream prepends BOS to token-id prompts unless the request has a session_cache;
  every request here carries one. With no BOS, ``token_utils.pad_tokens`` fails on
  the list of ids the orchestrator passes it (``list.shape``): it is wrapped here to
  take an array.
- ``orchestrator.delete_pytree`` calls ``jax.tree_map`` (gone from jax): replaced by the
  same function on ``jax.tree.map``.
- A stop token ends a JetStream stream without being sent (pxrt sends it as the last
  token): the check compares pxrt's tokens less a final EOS; the timings count the
  stop token for both, arriving with the (empty) response of the step that made it.
- 0.2.2's ``prefill`` returns only a prefix, so the first token reaches the client
  from a ``generate`` step: this engine samples it in prefill, and each step sends the
  token it feeds the model (the one sampled the step before).
- JetStream ends a request when a step reports more than ``max_tokens`` tokens for its
  slot: each request costs one more step in its slot than it has tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import decoder_shapes as ds  # noqa: E402
import generation  # noqa: E402

from pxrt.decoder.relayout import tiers_text  # noqa: E402

NO_BOS = "no-bos"  # a non-empty session_cache: JetStream 0.2.2 then prepends no BOS
SWEEP_SHAPES = ("demo", "js-small", "js-wide", "keras-llama")
SWEEP_SLOTS = (8, 16, 32, 64)


# --------------------------------------------------------------------------- JetStream


def import_jetstream() -> types.SimpleNamespace:
    """Import JetStream 0.2.2's orchestrator without seqio (TensorFlow), quiet its
    logging and patch what newer jax broke."""
    # token_utils imports seqio.vocabularies only for SentencePiece text tokenizers.
    seqio = types.ModuleType("seqio")
    vocabularies = types.ModuleType("seqio.vocabularies")
    vocabularies.Vocabulary = type("Vocabulary", (), {})
    vocabularies.SentencePieceVocabulary = type("SentencePieceVocabulary", (), {})
    seqio.vocabularies = vocabularies
    sys.modules.setdefault("seqio", seqio)
    sys.modules.setdefault("seqio.vocabularies", vocabularies)

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    import jetstream
    from jetstream.core import orchestrator
    from jetstream.core.proto import jetstream_pb2
    from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

    # Importing orchestrator set the root logger to DEBUG with a stdout handler, and it
    # logs on the root logger from its threads (every step) and per request: drop its
    # records below ERROR, put the root logger back.
    root.handlers[:] = handlers
    root.setLevel(level)
    jetstream_dir = os.path.dirname(os.path.abspath(jetstream.__file__))
    root.addFilter(lambda r: r.levelno >= logging.ERROR or not r.pathname.startswith(jetstream_dir))

    # jax.tree_map is gone from jax: the same function on jax.tree.map. It runs on every
    # insert, in a thread that SIGKILLs the process on any exception.
    def delete_pytree(p) -> None:
        def delete_leaf(leaf) -> None:
            if isinstance(leaf, jax.Array):
                leaf.delete()

        jax.tree.map(delete_leaf, p)

    orchestrator.delete_pytree = delete_pytree

    # With is_bos=False, pad_tokens does `tokens.shape` on the list of ids the
    # orchestrator hands it (only the BOS branch makes an array).
    pad_tokens = token_utils.pad_tokens

    def pad_tokens_array(tokens, *args, **kwargs):
        return pad_tokens(np.asarray(tokens, np.int32), *args, **kwargs)

    token_utils.pad_tokens = pad_tokens_array
    return types.SimpleNamespace(
        orchestrator=orchestrator,
        jetstream_pb2=jetstream_pb2,
        engine_api=engine_api,
        tokenizer_api=tokenizer_api,
        tokenizer_pb2=tokenizer_pb2,
    )


def make_engine(js: types.SimpleNamespace, model: ds.Model, slots: int, lengths: tuple[int, ...]):
    """A JetStream 0.2.2 ``Engine`` over ``model``'s prefill and decode."""
    engine_api, tokenizer_api, tokenizer_pb2 = js.engine_api, js.tokenizer_api, js.tokenizer_pb2

    class IdTokenizer(tokenizer_api.Tokenizer):
        """Client-side tokenization: token ids in and out, nothing to encode or decode."""

        def encode(self, s, **kwargs):
            raise NotImplementedError("token ids only")

        def decode(self, token_ids, **kwargs) -> str:
            return ""

        @property
        def pad_id(self) -> int:
            return 0

        @property
        def eos_id(self) -> int:
            return model.eos

        @property
        def bos_id(self) -> int:
            return model.bos

        @property
        def stop_tokens(self) -> set[int]:
            # Not the default {eos, pad}: pad 0 is a token the model can generate.
            return {model.eos}

    class ModelEngine(engine_api.Engine):
        """Prefix: the prompt's cache rows (the model's cache layout, one row of
        ``bucket`` positions), its first token (sampled in prefill) and length. Decode
        state: the cache of ``slots`` rows of ``max_length`` positions and per slot the
        next token to send, its position and the tokens sent so far. Each ``generate``
        sends every slot's next token and runs it through the model for the one after."""

        def __init__(self) -> None:
            self.slots = slots
            self.max_length = model.max_length
            self.params = jax.device_put(model.params)
            self.device = jax.devices()[0]
            self.steps = 0
            last = model.max_length - 1

            def init():
                return {
                    "cache": model.empty_cache(slots),
                    "tokens": jnp.zeros(slots, jnp.int32),
                    "positions": jnp.zeros(slots, jnp.int32),
                    "generated": jnp.zeros(slots, jnp.int32),
                }

            def prefill(params, tokens, true_length):
                rows, logits = model.prefill(params, tokens[None], true_length[None])
                first = jnp.argmax(logits[0], axis=-1).astype(jnp.int32)
                return {"cache": rows, "token": first, "length": true_length}

            def insert(prefix, state, slot):
                return {
                    "cache": model.put_rows(state["cache"], prefix["cache"], slot),
                    "tokens": state["tokens"].at[slot].set(prefix["token"]),
                    "positions": state["positions"].at[slot].set(prefix["length"]),
                    "generated": state["generated"].at[slot].set(0),
                }

            def generate(params, state):
                tokens = state["tokens"]
                positions = jnp.minimum(state["positions"], last)  # finished slots run on
                cache, logits = model.decode(params, state["cache"], tokens, positions)
                generated = state["generated"] + 1
                # ResultTokens.data: [slots, token | valid | length]; a new array, never
                # a leaf of the state (donated by the next step).
                data = jnp.stack([tokens, jnp.ones_like(tokens), generated], axis=1)
                return {
                    "cache": cache,
                    "tokens": jnp.argmax(logits, axis=-1).astype(jnp.int32),
                    "positions": state["positions"] + 1,
                    "generated": generated,
                }, data

            self._init = jax.jit(init)
            self._prefill = jax.jit(prefill)
            self._insert = jax.jit(insert, donate_argnums=(1,))
            self._generate = jax.jit(generate, donate_argnums=(1,))

        def warm(self) -> None:
            """Compile and run every program once (each prefill bucket and its insert)."""
            state = self.init_decode_state()
            for n in lengths:
                prefix = self.prefill(
                    params=self.params, padded_tokens=jnp.zeros(n, jnp.int32), true_length=n
                )
                state = self.insert(prefix, state, self.slots - 1)
                state, result = self.generate(self.params, state)
                result.convert_to_numpy()
            jax.block_until_ready(state)
            self.steps = 0

        # The API.
        def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length):
            if existing_prefix is not None:
                raise NotImplementedError("existing_prefix")
            return self._prefill(params, padded_tokens, np.int32(true_length))

        def insert(self, prefix, decode_state, slot: int):
            return self._insert(prefix, decode_state, np.int32(slot))

        def generate(self, params, decode_state):
            decode_state, data = self._generate(params, decode_state)
            self.steps += 1
            return decode_state, engine_api.ResultTokens(
                data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
                samples_per_slot=1,
            )  # fmt: skip

        def init_decode_state(self, *args, **kwargs):
            return self._init()

        def load_params(self, *args, **kwargs):
            return self.params

        def get_prefix_destination_sharding(self):
            return jax.sharding.SingleDeviceSharding(self.device)

        def get_tokenizer(self):
            return tokenizer_pb2.TokenizerParameters(path="token-ids")

        def build_tokenizer(self, metadata):
            return IdTokenizer()

        @property
        def max_concurrent_decodes(self) -> int:
            return self.slots

        @property
        def samples_per_slot(self) -> int:
            return 1

        @property
        def max_prefill_length(self) -> int:
            return lengths[-1]

        @property
        def mesh(self):
            return jax.sharding.Mesh(np.array([self.device]), ("x",))

        @property
        def colocated_cpus(self):
            return None

    return ModelEngine()


class JetStreamTarget:
    """JetStream's Driver + LLMOrchestrator in this process; ``Decode`` called directly."""

    def __init__(
        self, js: types.SimpleNamespace, model: ds.Model, slots: int, lengths: tuple[int, ...]
    ) -> None:
        self.js = js
        self.engine = make_engine(js, model, slots, lengths)
        self.engine.warm()
        self.max_length = model.max_length
        self.driver = js.orchestrator.Driver(
            prefill_engines=[self.engine],
            generate_engines=[self.engine],
            prefill_params=[self.engine.params],
            generate_params=[self.engine.params],
            interleaved_mode=True,
        )
        self.orchestrator = js.orchestrator.LLMOrchestrator(driver=self.driver)

    def request(self, prompt: np.ndarray, max_tokens: int):
        pb2 = self.js.jetstream_pb2
        return pb2.DecodeRequest(
            session_cache=NO_BOS,
            # pxrt stops at the cache's end; JetStream's engine leaves that to the caller.
            max_tokens=min(max_tokens, self.max_length - len(prompt)),
            token_content=pb2.DecodeRequest.TokenContent(token_ids=prompt.tolist()),
        )

    async def tokens(self, prompt: np.ndarray, max_tokens: int) -> list[int]:
        out: list[int] = []
        async for response in self.orchestrator.Decode(self.request(prompt, max_tokens)):
            out.extend(response.stream_content.samples[0].token_ids)
        return out

    def stop(self) -> None:
        """Stop the driver's threads (again: a no-op)."""
        self.driver.stop()


# --------------------------------------------------------------------------- clients


async def one_jetstream(target: JetStreamTarget, prompt, max_tokens, record) -> None:
    """As ``generation.one`` records pxrt: a time per token as it arrives."""
    t0 = time.perf_counter()
    request = target.request(prompt, max_tokens)
    times = []
    async for response in target.orchestrator.Decode(request):
        now = time.perf_counter()
        ids = response.stream_content.samples[0].token_ids
        times.extend([now] * len(ids))
    # The last response has no token. Before max_tokens, it is the step that generated a
    # stop token, which JetStream does not send (pxrt does, as the last token): count it
    # as a token that came then, as pxrt's does.
    if len(times) < request.max_tokens:
        times.append(now)
    record["ttft"].append(times[0] - t0)
    record["itl"].extend(np.diff(times).tolist())
    record["tokens"] += len(times)
    record["stamps"].extend(times)


async def one_of_either(kind: str, target, prompt, max_tokens, record) -> None:
    if kind == "pxrt":
        await generation.one("pxrt", target, prompt, max_tokens, record)
    else:
        await one_jetstream(target, prompt, max_tokens, record)


async def closed(kind: str, target, work, callers: int) -> dict:
    """``generation.closed``, for either target."""
    return await generation.closed(kind, target, work, callers, one=one_of_either)


async def pxrt_tokens(dec, prompt: np.ndarray, max_tokens: int) -> list[int]:
    return [t async for t in dec.agenerate(prompt, max_tokens=max_tokens)]


async def check(dec, js: JetStreamTarget, work, eos: int) -> tuple[list[str], dict, bool]:
    """Both targets on the same prompts at once (so several slots are busy): JetStream's
    tokens should be pxrt's, less a final EOS (JetStream does not send stop tokens).
    Returns the report, pxrt's tokens by request and whether all were the same."""
    a = await asyncio.gather(*(pxrt_tokens(dec, p, m) for p, m in work))
    b = await asyncio.gather(*(js.tokens(p, m) for p, m in work))
    lines = []
    same = stops = 0
    for i, ((prompt, m), x, y) in enumerate(zip(work, a, b)):
        stopped = bool(x) and x[-1] == eos
        stops += stopped
        want = x[:-1] if stopped else x
        if want == y:
            same += 1
            continue
        at = next((j for j, (u, v) in enumerate(zip(want, y)) if u != v), min(len(want), len(y)))
        lines.append(
            f"  MISMATCH request {i} (prompt {len(prompt)} tokens, max_tokens {m}): pxrt "
            f"{len(x)} tokens{' (EOS last)' if stopped else ''}, JetStream {len(y)}; first "
            f"difference at token {at}: pxrt {want[at : at + 5]} vs JetStream {y[at : at + 5]}"
        )
    lines.insert(
        0,
        f"correctness: {same}/{len(work)} requests give the same greedy tokens in pxrt and "
        f"JetStream ({stops} stopped at EOS; {sum(map(len, a))} pxrt tokens)",
    )
    return lines, dict(enumerate(a)), same == len(work)


# --------------------------------------------------------------------------- one configuration


def run_config(js_modules, model: ds.Model, lengths, work, slots: int, callers: int, args) -> dict:
    """pxrt and JetStream at ``slots`` slots on ``work``: the check, then the runs
    alternated; for keras-hub's Llama, its ``generate`` too, a run in each round (the
    first on the check's prompts, checked token for token against pxrt's). Returns the
    medians per system, the check's report and the peer's numbers."""
    if args.tiers == "learned":  # (sized by a decoder that served the workload once)
        model.options["length_tiers"] = learned_tiers(model, work, slots, callers) or "off"
    elif args.tiers in ("auto", "off"):  # (auto: the default from 16 slots on CPU)
        model.options["length_tiers"] = args.tiers
    elif args.tiers:  # (pxrt's cache in length tiers sized for this slot count)
        model.options["length_tiers"] = tiers_for(args.tiers, slots, model.max_length)
    dec = model.load(slots)
    generation.settle(dec, work, model.shape, callers, f"[{model.shape.name} x {slots} slots] ")
    t0 = time.perf_counter()
    js = JetStreamTarget(js_modules, model, slots, lengths)
    print(
        f"[{model.shape.name} x {slots} slots] pxrt: {dec!r} ({model.load_s:.1f}s to "
        f"ready, {model.all_s:.1f}s to every program); "
        f"JetStream: Driver + LLMOrchestrator, interleaved, {slots} slots, "
        f"max_prefill_length {lengths[-1]} ({time.perf_counter() - t0:.1f}s to compile "
        "and warm)",
        flush=True,
    )
    targets = {"pxrt": dec, "jetstream": js}
    peer = model.lm is not None and args.keras_peer
    if peer:
        targets["keras"] = None
    runs: dict[str, list[dict]] = {}
    report: list[str] = []
    out: dict = {"shape": model.shape.name, "slots": slots, "callers": callers, "n": len(work)}

    def keras_run(rep: int) -> None:
        """keras-hub's ``generate()`` over the workload (its first run on ``work`` itself,
        checked against pxrt's tokens; then fresh prompts of the same lengths, as the
        others get)."""
        k = ds.keras_generate(model, work if rep == 0 else ds.fresh_tokens(work, model.shape, rep),
                              slots)  # fmt: skip
        if rep == 0:
            want = {i: out["pxrt tokens"][i] for i in range(min(args.check, len(work)))}
            same, lines = ds.compare_tokens(want, k["outputs"])
            out["keras"] = k | {"same": same, "checked": len(want), "rates": []}
            line = (
                f"keras-hub generate(): {k['tokens']} tokens in {k['batches']} "
                f"length-sorted batches of {slots}, {k['shapes']} padded lengths; "
                f"{same}/{len(want)} requests token-equal with pxrt"
            )
            report.append(line)
            report.extend(lines)
            print(line, *lines, sep="\n", flush=True)
        out["keras"]["rates"].append(k["tok/s"])
        print(f"  run {rep + 1} {'keras-hub':<9} {k['tok/s']:>7.0f} tok/s ({k['elapsed']:.1f}s)",
              flush=True)  # fmt: skip

    async def bench() -> None:
        try:
            await runs_of_both()
        finally:
            # Inside the loop: the detokenize thread's last call_soon_threadsafe for a
            # finished request can come after its stream ended, and an exception in
            # that thread (a closed loop) SIGKILLs the process.
            js.stop()

    async def runs_of_both() -> None:
        # The check doubles as the warm-up of both paths.
        lines, out["pxrt tokens"], out["check ok"] = await check(
            dec, js, work[: args.check], model.eos
        )
        out["check"] = lines[0].split(" requests")[0].split(": ")[1]
        report.extend(lines)
        print("\n".join(report), flush=True)
        gc.collect()
        gc.freeze()
        for rep in range(args.repeats):
            order = list(targets) if rep % 2 == 0 else list(targets)[::-1]
            for kind in order:
                if kind == "keras":
                    keras_run(rep)
                    continue
                c0 = dict(dec.counters)
                steps0 = js.engine.steps
                # (each run on prompts of its own: none is in pxrt's prefix cache)
                fresh = ds.fresh_tokens(work, model.shape, rep)
                r = await closed(kind, targets[kind], fresh, callers)
                c = {k: v - c0.get(k, 0) for k, v in dec.counters.items()}
                steps = c["steps"] if kind == "pxrt" else js.engine.steps - steps0
                s = generation.summary(r) | {"steps": steps, "tokens": r["tokens"]}
                runs.setdefault(kind, []).append(s)
                # pxrt's own account: its prefills (prompts per program) and its steps'
                # mean wall time (the loop's step, host and device).
                more = (
                    f"; {c.get('prefills', 0)} prefills of {c.get('prefill_rows', 0)} "
                    f"prompts, {c.get('chunks', 0)} chunks of {c.get('chunk_rows', 0)} rows, "
                    f"step {1e3 * c.get('step_wall_s', 0) / max(steps, 1):.2f} ms"
                    if kind == "pxrt"
                    else ""
                )
                print(
                    f"  run {rep + 1} {kind:<9} {s['tok/s']:>7.0f} tok/s, ttft p50 "
                    f"{s['ttft p50']:.1f} ms, itl p50/p99 {s['itl p50']:.2f}/"
                    f"{s['itl p99']:.2f} ms, {r['tokens']} tokens in {steps} steps{more} "
                    f"({r['elapsed']:.1f}s)",
                    flush=True,
                )

    try:
        asyncio.run(bench())
    finally:
        js.stop()
        dec.close()
        gc.unfreeze()
    if dec.auto_tiers:  # (a switch during the runs would have compiled beside them)
        tiers = tiers_text(dec.tiers) or "one cache"
        print(
            f"[{model.shape.name} x {slots} slots] after the runs: {tiers}, "
            f"{dec.counters['relayouts']} switch(es) in all",
            flush=True,
        )
    out["report"] = report
    out["runs"] = runs
    out["med"] = {
        kind: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        for kind, rows in runs.items()
    }
    if peer:  # (the median of its runs, alternated with the others')
        out["keras"]["tok/s"] = statistics.median(out["keras"]["rates"])
    return out


# --------------------------------------------------------------------------- tables


def print_detail(res: dict, requests: int, repeats: int) -> None:
    """One configuration's table (as before the sweep existed)."""
    print()
    print(
        f"{res['shape']}: closed loop, {requests} requests, {res['callers']} callers, "
        f"{res['slots']} slots; medians of {repeats}"
    )
    head = ("tok/s", "steady tok/s", "ttft p50", "ttft p99", "itl p50", "itl p99", "steps")
    widths = [13 if h == "steady tok/s" else 10 for h in head]
    print(f"{'':<10}" + "".join(f"{h:>{w}}" for h, w in zip(head, widths)))
    med = res["med"]
    for kind, m in med.items():
        print(
            f"{kind:<10}{m['tok/s']:>10.0f}{m['steady tok/s']:>13.0f}"
            f"{m['ttft p50']:>9.1f}m{m['ttft p99']:>9.1f}m"
            f"{m['itl p50']:>9.2f}m{m['itl p99']:>9.2f}m{m['steps']:>10.0f}"
        )
    if len(med) == 2:
        a, b = med["pxrt"], med["jetstream"]
        print(
            f"{'pxrt/js':<10}"
            + "".join(
                f"{a[k] / b[k]:>{w - 1}.2f}x" if b[k] else f"{'-':>{w}}"
                for k, w in zip(head, widths)
            )
        )
    if "keras" in res:
        k = res["keras"]
        print(
            f"keras-hub generate() {k['tok/s']:.0f} tok/s (median of "
            f"{len(k['rates'])} alternated runs): pxrt/keras-hub "
            f"{med['pxrt']['tok/s'] / k['tok/s']:.2f}x"
        )


def print_sweep(results: list[dict]) -> None:
    """One line per shape and slot count."""
    print()
    print(
        f"{'shape':<12}{'slots':>6}{'reqs':>6}{'pxrt tok/s':>11}{'js tok/s':>10}{'ratio':>7}"
        f"{'itl p50 px/js':>15}{'itl p99 px/js':>15}{'ttft p50 px/js':>16}"
        f"{'check':>8}{'keras tok/s':>12}{'px/keras':>9}"
    )
    for r in results:
        a, b = r["med"]["pxrt"], r["med"]["jetstream"]
        keras = r.get("keras")
        ktok = f"{keras['tok/s']:>12.0f}" if keras else f"{'':>12}"
        kratio = f"{a['tok/s'] / keras['tok/s']:>8.2f}x" if keras else f"{'':>9}"
        print(
            f"{r['shape']:<12}{r['slots']:>6}{r['n']:>6}{a['tok/s']:>11.0f}{b['tok/s']:>10.0f}"
            f"{a['tok/s'] / b['tok/s']:>6.2f}x"
            f"{a['itl p50']:>7.2f}/{b['itl p50']:<7.2f}{a['itl p99']:>7.2f}/{b['itl p99']:<7.2f}"
            f"{a['ttft p50']:>8.1f}/{b['ttft p50']:<7.1f}{r['check']:>8}{ktok}{kratio}"
        )
    print("(ITL and TTFT in ms; check: greedy requests token-equal pxrt/JetStream)")


# --------------------------------------------------------------------------- main


def load_option(text: str) -> tuple[str, object]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"--load takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def tiers_for(shares: str, slots: int, max_length: int) -> str:
    """``--tiers`` (``FRACTION:WEIGHT,...``: each tier's length as a fraction of
    ``max_length`` and its share of the slots) as ``length_tiers`` for ``slots`` slots:
    every tier at least one slot, the rounding taken from the largest."""
    pairs = [(float(f), float(w)) for f, w in (t.split(":") for t in shares.split(","))]
    total = sum(w for _, w in pairs)
    counts = [max(1, round(slots * w / total)) for _, w in pairs]
    counts[counts.index(max(counts))] += slots - sum(counts)
    return "+".join(f"{n}x{round(f * max_length)}" for (f, _), n in zip(pairs, counts))


def learned_tiers(model: ds.Model, work, slots: int, callers: int) -> str | None:
    """``--tiers learned``: the ``length_tiers`` a one-cache decoder suggests after
    serving ``work`` (on prompts of their own) in a closed loop, until it has seen
    enough turns (``Decoder.suggested_length_tiers``); None: one cache."""
    model.options["length_tiers"] = "off"  # (one cache, never changed while it learns)
    learner = model.load(slots)
    try:
        for rep in range(4):
            fresh = ds.fresh_tokens(work, model.shape, 100 + rep)
            asyncio.run(closed("pxrt", learner, fresh, callers))
            if learner.suggested_length_tiers():
                break
        got = learner.suggested_length_tiers()
    finally:
        learner.close()
    print(f"[{model.shape.name} x {slots} slots] length_tiers learned: {got}", flush=True)
    return got


def requests_for(args: argparse.Namespace, slots: int) -> int:
    if args.requests:
        return args.requests
    return max(32, 2 * slots) if args.quick else max(128, 8 * slots)


def requests_note(args: argparse.Namespace) -> str:
    if args.requests:
        return f"{args.requests} requests"
    return "2 requests per slot (at least 32)" if args.quick else "8 per slot (at least 128)"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ds.add_shape_args(p)
    ds.add_workload_args(p)
    g = p.add_argument_group("run")
    g.add_argument("--requests", type=int, help="default 8 per slot (--quick 2), >= 128 (32)")
    g.add_argument("--slots", help="slot count(s), comma-separated (default 32; sweep 8,16,32,64)")
    g.add_argument("--callers", "--concurrency", type=int, help="closed loop (default: slots)")
    g.add_argument("--repeats", type=int, help="alternated runs of each (default 3, --quick 1)")
    g.add_argument("--check", type=int, default=16, help="requests in the correctness check")
    g.add_argument(
        "--load",
        action="append",
        default=[],
        type=load_option,
        metavar="KEY=VALUE",
        help="a pxrt load option (VALUE as JSON), e.g. overlap_prefill=false; default none",
    )
    g.add_argument(
        "--tiers",
        metavar="FRACTION:WEIGHT,...",
        help="pxrt's length_tiers for each slot count: each tier's length as a fraction of "
        "max_length and its share of the slots, e.g. 0.25:10,0.5:5,1:1; 'learned': those "
        "a one-cache decoder suggests after serving the workload once; 'auto' (the "
        "default from 16 slots on CPU) or 'off': length_tiers so",
    )
    g.add_argument("--no-keras-peer", dest="keras_peer", action="store_false",
                   help="skip keras-hub's generate() on keras-llama")  # fmt: skip
    g.add_argument("--sweep", action="store_true", help="every shape of --shapes at every --slots")
    g.add_argument("--shapes", default=",".join(SWEEP_SHAPES), help="the sweep's shapes")
    g.add_argument("--quick", action="store_true", help="fewer requests, one repeat")
    args = p.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    default_slots = SWEEP_SLOTS if args.sweep else (32,)
    slot_counts = tuple(int(x) for x in args.slots.split(",")) if args.slots else default_slots
    names = [x for x in args.shapes.split(",") if x] if args.sweep else [args.shape]
    for name in names:
        if name not in ds.SHAPES:
            p.error(f"--shapes: {name!r} is not one of {', '.join(ds.SHAPES)}")

    js_modules = import_jetstream()
    from importlib.metadata import version

    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; google-jetstream "
        f"{version('google-jetstream')}; {os.cpu_count()} CPUs",
        flush=True,
    )
    results = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pxrt-js-") as tmp:
        for name in names:
            shape = ds.shape_from_args(args, name)
            most = max(requests_for(args, n) for n in slot_counts)
            work = ds.workload(most, shape, args.prompts, args.outputs, args.seed)
            lengths = ds.prefill_lengths(work, shape.max_length)
            model = ds.Model(shape, args.seed, dict(args.load))
            model.export(tmp, lengths)
            print(
                f"\n{shape.describe()}\n  {ds.describe_work(work, args.prompts, args.outputs)}"
                f"\n  prefill lengths {lengths}; exported in {model.export_s:.1f}s",
                flush=True,
            )
            for slots in slot_counts:
                callers = args.callers or slots
                n = requests_for(args, slots)
                res = run_config(js_modules, model, lengths, work[:n], slots, callers, args)
                results.append(res)
                if not args.sweep:
                    print_detail(res, n, args.repeats)
                    print()
                    print("\n".join(res["report"]))
    if len(results) > 1 or args.sweep:  # (a sweep of one configuration: its table too)
        print(
            f"\n{requests_note(args)}, prompts {args.prompts}, outputs {args.outputs}; "
            f"closed loop, callers {args.callers or '= slots'}; medians of {args.repeats} "
            f"alternated runs; {time.perf_counter() - t_start:.0f}s in all"
        )
        print_sweep(results)
    bad = [f"{r['shape']} x {r['slots']}" for r in results if not r["check ok"]]
    bad += [
        f"{r['shape']} x {r['slots']} (keras-hub)"
        for r in results
        if "keras" in r and r["keras"]["same"] != r["keras"]["checked"]
    ]
    if bad:
        print(f"\nTOKENS DIFFER: {', '.join(bad)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
