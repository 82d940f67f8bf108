"""Generation: pxrt vs JetStream 0.2.2's orchestrator, same model, same workload.

The demo decoder (``pxrt.demo``'s ``lm_prefill``/``lm_decode``, the same params) served
two ways in one process, greedy decoding:

- pxrt: the model exported with ``pxrt.demo.export_lm`` (``--slots`` slots, prefill
  lengths 16/32/64/128) and ``Decoder.agenerate``;
- JetStream: ``google-jetstream==0.2.2``'s ``Driver`` + ``LLMOrchestrator`` driven in
  process (``Decode`` called directly, no gRPC server), over an ``Engine`` written here
  the way JetStream's own engines are: ``max_concurrent_decodes = --slots``, one jitted
  prefill per bucket (JetStream pads prompts to 16/32/64/128, max_prefill_length 128),
  a jitted ``insert`` and ``generate`` that donate the decode state (KV cache and
  per-slot vectors), greedy sampling on device, all compiled and warmed before timing.
  Interleaved mode (prefill and generate on the same engine and device). Token ids in
  and out (client-side tokenization).

Same requests as ``benchmarks/generation.py`` (its ``workload``: Pareto prompt and
output lengths), a closed loop of ``--concurrency`` callers, measured as there (output
tokens/s, time to first token and inter-token latency p50/p99). The runs alternate,
``--repeats`` times; the table shows medians and the pxrt/JetStream ratios. Before
that, a correctness check: the first prompts through both, token for token.

Needs the side venv (``bash benchmarks/jetstream_env.sh``):

    .venv-jetstream/bin/python benchmarks/jetstream_compare.py \\
        [--requests 1024] [--slots 32] [--repeats 3] [--concurrency 64]

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
from jax import lax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import generation  # noqa: E402

import pxrt  # noqa: E402
from pxrt import demo  # noqa: E402

PREFILL_LENGTHS = (16, 32, 64, 128)
NO_BOS = "no-bos"  # a non-empty session_cache: JetStream 0.2.2 then prepends no BOS


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


def make_engine(js: types.SimpleNamespace, params, slots: int, max_length: int):
    """A JetStream 0.2.2 ``Engine`` over ``pxrt.demo``'s decoder."""
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
            return demo.LM_EOS

        @property
        def bos_id(self) -> int:
            return demo.LM_BOS

        @property
        def stop_tokens(self) -> set[int]:
            # Not the default {eos, pad}: pad 0 is a byte the model can generate.
            return {demo.LM_EOS}

    class DemoEngine(engine_api.Engine):
        """Prefix: the prompt's KV rows ``[1, layers, bucket, heads, hd]``, its first
        token (sampled in prefill) and length. Decode state: the KV cache ``[slots,
        layers, max_length, heads, hd]`` and per slot the next token to send, its
        position and the tokens sent so far. Each ``generate`` sends every slot's next
        token and runs it through the model for the one after."""

        def __init__(self) -> None:
            self.slots = slots
            self.max_length = max_length
            self.params = jax.device_put(params)
            self.device = jax.devices()[0]
            self.steps = 0
            layers = len(params["layers"])
            heads = params["layers"][0]["heads"].shape[0]
            hd = params["embed"].shape[1] // heads
            shape = (slots, layers, max_length, heads, hd)
            last = max_length - 1

            def init():
                return {
                    "k": jnp.zeros(shape, jnp.float32),
                    "v": jnp.zeros(shape, jnp.float32),
                    "tokens": jnp.zeros(slots, jnp.int32),
                    "positions": jnp.zeros(slots, jnp.int32),
                    "generated": jnp.zeros(slots, jnp.int32),
                }

            def prefill(params, tokens, true_length):
                rows, logits = demo.lm_prefill(params, tokens[None], true_length[None])
                first = jnp.argmax(logits[0], axis=-1).astype(jnp.int32)
                return {"k": rows["k"], "v": rows["v"], "token": first, "length": true_length}

            def insert(prefix, state, slot):
                at = (slot, 0, 0, 0, 0)
                return {
                    "k": lax.dynamic_update_slice(state["k"], prefix["k"], at),
                    "v": lax.dynamic_update_slice(state["v"], prefix["v"], at),
                    "tokens": state["tokens"].at[slot].set(prefix["token"]),
                    "positions": state["positions"].at[slot].set(prefix["length"]),
                    "generated": state["generated"].at[slot].set(0),
                }

            def generate(params, state):
                tokens = state["tokens"]
                positions = jnp.minimum(state["positions"], last)  # finished slots run on
                cache, logits = demo.lm_decode(
                    params, {"k": state["k"], "v": state["v"]}, tokens, positions
                )
                generated = state["generated"] + 1
                # ResultTokens.data: [slots, token | valid | length]; a new array, never
                # a leaf of the state (donated by the next step).
                data = jnp.stack([tokens, jnp.ones_like(tokens), generated], axis=1)
                return {
                    "k": cache["k"],
                    "v": cache["v"],
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
            for n in PREFILL_LENGTHS:
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
            return PREFILL_LENGTHS[-1]

        @property
        def mesh(self):
            return jax.sharding.Mesh(np.array([self.device]), ("x",))

        @property
        def colocated_cpus(self):
            return None

    return DemoEngine()


class JetStreamTarget:
    """JetStream's Driver + LLMOrchestrator in this process; ``Decode`` called directly."""

    def __init__(self, js: types.SimpleNamespace, params, slots: int, max_length: int) -> None:
        self.js = js
        self.engine = make_engine(js, params, slots, max_length)
        self.engine.warm()
        self.max_length = max_length
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


async def closed(kind: str, target, work, concurrency: int) -> dict:
    """``generation.closed``, for either target."""
    return await generation.closed(kind, target, work, concurrency, one=one_of_either)


async def pxrt_tokens(dec, prompt: np.ndarray, max_tokens: int) -> list[int]:
    return [t async for t in dec.agenerate(prompt, max_tokens=max_tokens)]


async def check(dec, js: JetStreamTarget, work) -> list[str]:
    """Both targets on the same prompts at once (so several slots are busy): JetStream's
    tokens should be pxrt's, less a final EOS (JetStream does not send stop tokens)."""
    a = await asyncio.gather(*(pxrt_tokens(dec, p, m) for p, m in work))
    b = await asyncio.gather(*(js.tokens(p, m) for p, m in work))
    lines = []
    same = stops = 0
    for i, ((prompt, m), x, y) in enumerate(zip(work, a, b)):
        stopped = bool(x) and x[-1] == demo.LM_EOS
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
    return lines


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--max-output", type=int, default=192)
    p.add_argument("--check", type=int, default=16, help="requests in the correctness check")
    args = p.parse_args()
    if args.max_prompt > PREFILL_LENGTHS[-1]:
        p.error(f"--max-prompt: at most {PREFILL_LENGTHS[-1]} (the largest prefill length)")

    js_modules = import_jetstream()
    from importlib.metadata import version

    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; google-jetstream "
        f"{version('google-jetstream')}"
    )
    params = demo.make_lm_params()
    work = generation.workload(args.requests, 0, args.max_prompt, args.max_output)
    with tempfile.TemporaryDirectory(prefix="pxrt-js-") as tmp:
        t0 = time.perf_counter()
        path = demo.export_lm(
            os.path.join(tmp, "lm"), slots=args.slots, prefill_lengths=PREFILL_LENGTHS
        )
        dec = pxrt.load(path)
        print(f"pxrt: {dec!r} ({time.perf_counter() - t0:.1f}s to export and load)")
        t0 = time.perf_counter()
        js = JetStreamTarget(js_modules, params, args.slots, dec.max_length)
        print(
            f"JetStream: Driver + LLMOrchestrator, interleaved, {args.slots} slots, "
            f"max_prefill_length {PREFILL_LENGTHS[-1]} ({time.perf_counter() - t0:.1f}s "
            "to compile and warm)"
        )
        targets = {"pxrt": dec, "jetstream": js}
        runs: dict[str, list[dict]] = {}
        report: list[str] = []

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
            report.extend(await check(dec, js, work[: args.check]))
            print("\n".join(report), flush=True)
            gc.collect()
            gc.freeze()
            for rep in range(args.repeats):
                order = list(targets) if rep % 2 == 0 else list(targets)[::-1]
                for kind in order:
                    steps0 = dec.counters["steps"] if kind == "pxrt" else js.engine.steps
                    r = await closed(kind, targets[kind], work, args.concurrency)
                    steps = (dec.counters["steps"] if kind == "pxrt" else js.engine.steps) - steps0
                    s = generation.summary(r) | {"steps": steps, "tokens": r["tokens"]}
                    runs.setdefault(kind, []).append(s)
                    print(
                        f"  run {rep + 1} {kind:<9} {s['tok/s']:>7.0f} tok/s, ttft p99 "
                        f"{s['ttft p99']:.1f} ms, itl p99 {s['itl p99']:.2f} ms, "
                        f"{r['tokens']} tokens in {steps} steps ({r['elapsed']:.1f}s)",
                        flush=True,
                    )

        try:
            asyncio.run(bench())
        finally:
            js.stop()
            dec.close()

    print()
    print(
        f"closed loop, {args.requests} requests, {args.concurrency} callers, {args.slots} "
        f"slots; medians of {args.repeats}"
    )
    head = ("tok/s", "steady tok/s", "ttft p50", "ttft p99", "itl p50", "itl p99", "steps")
    widths = [13 if h == "steady tok/s" else 10 for h in head]
    print(f"{'':<10}" + "".join(f"{h:>{w}}" for h, w in zip(head, widths)))
    med = {}
    for kind, rows in runs.items():
        med[kind] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        m = med[kind]
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
    print()
    print("\n".join(report))


if __name__ == "__main__":
    main()
