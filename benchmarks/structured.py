"""Structured outputs' cost: tokens/s of generations held to a JSON schema against the
same generations free, alternated in one run, at a number of busy slots, on a decoder
with a realistic vocabulary; and the grammar's host time per token.

    python benchmarks/structured.py [--shape js-small] [--vocab 32000] [--slots 16] \\
        [--requests 64] [--max-tokens 64] [--repeats 3]

The model is ``decoder_shapes``' at ``--shape`` (random weights; ``keras-llama``:
keras-hub's ``LlamaCausalLM``, its functions as pxrt's adapter exports them) with a
byte-level BPE ``tokenizer.json`` of ``--vocab`` tokens trained here on Python's own
sources (what llguidance walks for every mask: a real tokenizer's trie, not bytes).
Each round runs ``--requests`` generations, ``--slots`` at a time (a closed loop:
every slot busy), of ``--max-tokens`` tokens each: free (no end token before it: the
random model's end token is one id in ``--vocab``) or under a JSON schema whose array
cannot end that soon (so that a constrained generation runs as long as a free one: the
lengths are reported). Reported: tokens/s of each, their ratio, and the grammar's host
seconds per constrained token (llguidance's masks and matcher updates, from the
decoder's ``grammar_s`` counter).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import decoder_shapes as ds  # noqa: E402

import pxrt  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 100,  # (never complete within max_tokens: as long as a free one)
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "role": {"enum": ["admin", "user", "guest"]},
                    "active": {"type": "boolean"},
                },
                "required": ["name", "age", "role", "active"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}


def train_tokenizer(vocab: int, path: str) -> str:
    """A byte-level BPE ``tokenizer.json`` of at most ``vocab - 2`` tokens (the model's
    last two ids are its BOS and EOS), trained on the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "..", "*.py")))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - 2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    tok.save(path)
    return path


async def round_(dec, prompts, params, slots) -> tuple[float, int, int]:
    """Every prompt generated, ``slots`` at a time: (seconds, tokens, generations that
    ended before ``max_tokens``)."""
    queue = list(prompts)
    tokens = ended = 0

    async def caller() -> None:
        nonlocal tokens, ended
        while queue:
            prompt = queue.pop()
            got = [t async for t in dec.agenerate(prompt, params)]
            tokens += len(got)
            ended += len(got) < params.max_tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(slots)))
    return time.perf_counter() - t0, tokens, ended


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ds.add_shape_args(p)
    p.set_defaults(shape="js-small", vocab=32000)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    shape = ds.shape_from_args(args)
    model = ds.Model(shape)
    print(shape.describe())
    with tempfile.TemporaryDirectory(prefix="pxrt-structured-") as tmp:
        t0 = time.perf_counter()
        tokenizer = train_tokenizer(shape.vocab, os.path.join(tmp, "tokenizer.json"))
        print(f"tokenizer: byte-level BPE trained in {time.perf_counter() - t0:.1f} s")
        lengths = (16, 32)
        if shape.family == "keras-llama":  # (keras-hub's functions, as its adapter makes them)
            model.export(os.path.join(tmp, "plain"), lengths, slots=args.slots)
        path = pxrt.export_decoder(
            model.prefill, model.decode, model.params, os.path.join(tmp, "lm"),
            cache=model.cache, extend=model.extend, chunk_lengths=lengths,
            max_length=shape.max_length, slots=args.slots, prefill_lengths=lengths,
            prefill_batches=(1, 4), eos_id=model.eos, tokenizer=tokenizer, name="lm",
        )  # fmt: skip
        dec = pxrt.load(path, slots=args.slots)
        assert dec.wait_programs(600)
        t0 = time.perf_counter()
        pxrt.decoder.grammar.grammars_of(dec)
        print(f"grammar engine over the tokenizer: {time.perf_counter() - t0:.2f} s, once")
        so = pxrt.StructuredOutput(json=SCHEMA)
        kinds = {
            "free": pxrt.SamplingParams(max_tokens=args.max_tokens, temperature=1.0),
            # (the step with the sampling controls, as a constrained slot runs it, and
            # the loop's overlap kept: what the grammar's own work adds is the rest)
            "controls": pxrt.SamplingParams(
                max_tokens=args.max_tokens, temperature=1.0, presence_penalty=0.01
            ),
            "json schema": pxrt.SamplingParams(
                max_tokens=args.max_tokens, temperature=1.0, structured=so
            ),
        }
        rng = np.random.default_rng(0)
        words = ["people", "records", "list", "users", "json", "data"]
        results: dict[str, list] = {k: [] for k in kinds}
        grammar: list[float] = []

        async def bench() -> None:
            for params in kinds.values():  # (warm-up)
                await round_(dec, ["warm up"] * args.slots, params, args.slots)
            for rep in range(args.repeats):
                order = list(kinds)[rep % len(kinds) :] + list(kinds)[: rep % len(kinds)]
                for kind in order:
                    prompts = [
                        " ".join(rng.choice(words, 6)) + f" {rep}.{i}:"
                        for i in range(args.requests)
                    ]
                    g0 = dec.counters["grammar_s"]
                    got = await round_(dec, prompts, kinds[kind], args.slots)
                    results[kind].append(got)
                    if kind == "json schema":
                        grammar.append((dec.counters["grammar_s"] - g0) / got[1])

        asyncio.run(bench())
        print(f"{args.requests} generations a round, {args.slots} slots busy, "
              f"max_tokens {args.max_tokens}, temperature 1, {args.repeats} rounds each, "
              "alternated")  # fmt: skip
        rates = {}
        for kind, runs in results.items():
            tps = [tokens / s for s, tokens, _ in runs]
            rates[kind] = statistics.median(tps)
            ended = sum(e for _, _, e in runs) / sum(args.requests for _ in runs)
            print(f"  {kind:12s} {rates[kind]:8.0f} tokens/s (median; runs "
                  f"{', '.join(f'{t:.0f}' for t in tps)}); ended early {ended:.0%}")  # fmt: skip
        for kind in ("controls", "json schema"):
            print(f"  ratio: {kind} / free = {rates[kind] / rates['free']:.2f}x")
        print(
            f"  grammar host time per constrained token: {statistics.median(grammar) * 1e6:.0f} us"
        )
        dec.close()


if __name__ == "__main__":
    main()
