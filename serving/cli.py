"""The ``pxrt`` command: ``pxrt demo | export SPEC DIR | inspect DIR | serve [DIR...] |
bench [DIR]``."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile

import numpy as np


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.model == "encoder":
        return _demo_encoder(args)
    if args.model == "lm":
        return _demo_lm(args)
    import jax

    import pxrt
    from pxrt import demo
    from pxrt.timing import compare, fmt_time

    with tempfile.TemporaryDirectory(prefix="pxrt-demo-") as tmp:
        path = args.keep or os.path.join(tmp, "mlp")
        demo.export_demo(path)
        print(f"exported the demo MLP ({demo.LAYERS} x {demo.WIDTH}, float32) to {path}")
        model = pxrt.load(path, progress=True)
        print(
            f"loaded {model}: {len(model.buckets)} buckets compiled in {model.load_s:.2f} s, "
            f"Cython handlers: {pxrt.using_extensions()}"
        )
        x = np.random.default_rng(0).standard_normal((5, demo.WIDTH)).astype(np.float32)
        y = model.run({"x": x})["y"]
        ref = np.asarray(jax.jit(demo.mlp)(demo.make_params(), x)["y"])
        print(
            f"run on 5 rows -> y{list(y.shape)}, max |pxrt - jax.jit| = "
            f"{float(np.abs(y - ref).max()):.2e}"
        )

        print(f"\nper call, median of interleaved rounds on {len(model.devices)} device(s):")
        print(f"{'bucket':>7}  {'Model.run':>11}  {'Compiled.__call__':>18}  {'ratio':>6}")
        for size in model.buckets:
            xb = np.random.default_rng(size).standard_normal((size, demo.WIDTH)).astype(np.float32)
            compiled = model.bucket(size).compiled
            request = {"x": xb}
            times = compare(
                {
                    "pxrt": functools.partial(model.run, request),
                    "jax": functools.partial(_run_compiled, compiled, model.params_dev, xb),
                },
                rounds=args.rounds,
                calls=args.calls,
            )
            print(
                f"{size:>7}  {fmt_time(times['pxrt']):>11}  {fmt_time(times['jax']):>18}  "
                f"{times['pxrt'] / times['jax']:>5.2f}x"
            )
        print(f"\ncompiles after load: {model.compiles_after_load}")
    return 0


def _run_compiled(compiled, params, x) -> list[np.ndarray]:
    """What a user of plain JAX does: call the compiled program, read its outputs."""
    return [np.asarray(o) for o in compiled(params, x)]


def _demo_encoder(args: argparse.Namespace) -> int:
    import asyncio

    import jax

    import pxrt
    from pxrt import demo

    from .engine.server import Server, new_event_loop

    with tempfile.TemporaryDirectory(prefix="pxrt-demo-") as tmp:
        path = args.keep or os.path.join(tmp, "encoder")
        demo.export_encoder(path)
        print(
            f"exported the demo encoder ({demo.ENC_LAYERS} layers, {demo.ENC_DIM} wide, "
            f"{demo.ENC_HEADS} heads; tokens int32[n, seq], mask bool[n, seq]) to {path}"
        )
        model = pxrt.load(path, progress=True)
        print(
            f"loaded {model}: {len(model.cells)} cells (batch x seq) compiled in "
            f"{model.load_s:.2f} s"
        )
        params = demo.make_encoder_params()
        reference = jax.jit(demo.encoder)
        worst = 0.0
        for length in (1, 31, 32, 33, 200, max(demo.ENC_SEQ_BUCKETS)):
            request = demo.encoder_request(2, length, seed=length)
            got, want = model.run(request), reference(params, **request)
            worst = max(worst, *(float(np.abs(got[k] - want[k]).max()) for k in got))
        print(
            f"lengths 1..{max(demo.ENC_SEQ_BUCKETS)}: outputs cut to each length; max |pxrt - "
            f"jax.jit on the unpadded input| = {worst:.2e}"
        )

        lengths = demo.token_lengths(2000, seed=1)
        requests = [demo.encoder_request(1, int(n), seed=i) for i, n in enumerate(lengths)]

        async def serve_all() -> tuple[float, dict]:
            async with Server() as server:
                server.add_model("encoder", model)
                t0 = asyncio.get_running_loop().time()
                await asyncio.gather(*(server.infer("encoder", r) for r in requests))
                elapsed = asyncio.get_running_loop().time() - t0
                return elapsed, server.metrics_snapshot()["encoder"]

        loop = new_event_loop()
        try:
            elapsed, snap = loop.run_until_complete(serve_all())
        finally:
            loop.close()
        print(
            f"served {len(requests)} requests of long-tailed lengths (median "
            f"{int(np.median(lengths))}, max {lengths.max()}) in {elapsed:.2f} s: "
            f"{len(requests) / elapsed:,.0f} req/s in {snap['batches']} batches"
        )
        print(f"compiles after load: {model.compiles_after_load}")
    return 0


def _demo_lm(args: argparse.Namespace) -> int:
    import asyncio

    import pxrt
    from pxrt import demo

    from .engine.server import new_event_loop

    with tempfile.TemporaryDirectory(prefix="pxrt-demo-") as tmp:
        path = args.keep or os.path.join(tmp, "lm")
        demo.export_lm(path, slots=32)
        print(
            f"exported the demo decoder ({demo.LM_LAYERS} layers, {demo.LM_DIM} wide, byte "
            f"vocabulary of {demo.LM_VOCAB}, random weights) to {path}"
        )
        dec = pxrt.load(path, progress=True)
        kinds = [p["program"] for p in dec.describe()["programs"]]
        print(
            f"loaded {dec}: the decode step, {kinds.count('prefill_insert')} prefill and "
            f"{kinds.count('extend_insert')} extend cells compiled in {dec.load_s:.2f} s; cache "
            f"{dec.cache_bytes / 2**20:.1f} MiB on the device(s), donated through every step"
        )
        prompts = [np.frombuffer(t.encode(), np.uint8).astype(np.int32) for t in _LM_PROMPTS]
        same = all(
            dec.generate(p, max_tokens=24).tokens == demo.lm_reference(p, 24) for p in prompts
        )
        print(f"greedy tokens equal plain JAX one prompt at a time: {'yes' if same else 'NO'}")
        # A prompt longer than the longest prefill, in chunks; then again, its start
        # from the prefix cache (whose programs, on a cold compile, come after the load).
        dec.wait_programs(600)
        long = np.frombuffer((_LM_PROMPTS[0] * 40)[:200].encode(), np.uint8).astype(np.int32)
        want = demo.lm_reference(long, 16)
        chunks = dec.counters["chunks"]
        first = dec.generate(long, max_tokens=16).tokens == want
        chunks = dec.counters["chunks"] - chunks
        hit = dec.counters["prefix_hit_tokens"]
        again = dec.generate(long, max_tokens=16).tokens == want
        hit = dec.counters["prefix_hit_tokens"] - hit
        print(
            f"a {len(long)}-token prompt (the longest prefill is {dec.max_prompt}) in {chunks} "
            f"chunks, then again with {hit} tokens from the prefix cache: equal to plain JAX: "
            f"{'yes' if first and again else 'NO'}"
        )
        print(f"streamed, sampled (temperature 1, top-k 40, seed 7) from {_LM_PROMPTS[0]!r}:")
        text = bytearray()
        for token in dec.stream(prompts[0], max_tokens=32, temperature=1.0, top_k=40, seed=7):
            text.extend([token] if token < 256 else b"")
        print(f"  {bytes(text)!r}")

        work = list(
            zip(
                demo.lm_prompts(1024, seed=1, high=64),
                demo.token_lengths(1024, low=8, high=192, seed=2),
            )
        )

        async def serve_all() -> tuple[float, list, list, int]:
            ttft: list[float] = []
            itl: list[float] = []
            count = 0
            it = iter(work)

            async def caller() -> None:
                nonlocal count
                clock = asyncio.get_running_loop().time
                for prompt, m in it:
                    t0 = clock()
                    times = [clock() async for _ in dec.agenerate(prompt, max_tokens=int(m))]
                    ttft.append(times[0] - t0)
                    itl.extend(np.diff(times).tolist())
                    count += len(times)

            t0 = asyncio.get_running_loop().time()
            await asyncio.gather(*(caller() for _ in range(64)))
            return asyncio.get_running_loop().time() - t0, ttft, itl, count

        loop = new_event_loop()
        try:
            c0 = dict(dec.counters)
            elapsed, ttft, itl, count = loop.run_until_complete(serve_all())
        finally:
            loop.close()
        steps = dec.counters["steps"] - c0["steps"]
        busy = (dec.counters["busy_slot_steps"] - c0["busy_slot_steps"]) / max(steps, 1)
        ms = lambda xs, q: f"{np.percentile(xs, q) * 1e3:.1f} ms"  # noqa: E731
        print(
            f"{len(work)} prompts (long-tailed prompt and output lengths), 64 callers: "
            f"{count / elapsed:,.0f} tokens/s, {busy:.1f} of {dec.slots} slots busy per step; "
            f"time to first token p50 {ms(ttft, 50)} p99 {ms(ttft, 99)}, between tokens p50 "
            f"{ms(itl, 50)} p99 {ms(itl, 99)}"
        )
        print(f"compiles after load: {dec.compiles_after_load}")
        dec.close()
    return 0


_LM_PROMPTS = ("The quick brown fox", "pxrt serves JAX", "Hello, world")


def _cmd_export(args: argparse.Namespace) -> int:
    import importlib

    import pxrt

    module_name, _, attr = args.spec.partition(":")
    if not attr:
        raise SystemExit("pxrt export: SPEC is MODULE:FUNCTION, e.g. pxrt.demo:spec")
    factory = getattr(importlib.import_module(module_name), attr)
    spec = dict(factory())
    if args.buckets:
        spec["batch_buckets"] = [int(b) for b in args.buckets.split(",")]
    if args.name:
        spec["name"] = args.name
    fn, params = spec.pop("fn"), spec.pop("params")
    path = pxrt.export(fn, params, args.out, overwrite=args.overwrite, **spec)
    art = pxrt.read_artifact(path)
    dims = "".join(f", {d} {list(v)}" for d, v in art.dim_buckets.items())
    print(
        f"exported {art.name} to {path}: inputs "
        f"{', '.join(f'{k} {s.describe()}' for k, s in art.inputs.items())}; "
        f"buckets {list(art.batch_buckets)}{dims}"
    )
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    import pxrt

    place = {
        k: getattr(args, k)
        for k in ("placement", "instances", "devices_per_instance")
        if getattr(args, k) is not None
    }
    if args.length_tiers:
        place["length_tiers"] = args.length_tiers
    model = pxrt.load(args.path, progress=not args.json, **place)
    if hasattr(model, "wait_programs"):  # (a decoder: every program, those compiled after)
        model.wait_programs()
    info = model.describe()
    close = getattr(model, "close", None)
    if close is not None:  # (a decoder's thread, timing its programs while idle, stops)
        close()
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        print()
        return 0
    m = info["manifest"]
    print(
        f"{m['name']} version {m['version']}  (format {m['format_version']}, exported with "
        f"jax {m['jax_version']}, x64={m['x64']})"
    )
    if info.get("kind") == "decoder":
        return _inspect_decoder(info)
    for kind in ("inputs", "outputs"):
        print(f"{kind}:")
        for t in m[kind]:
            pad = (
                f"  pad {t['pad']}"
                if "pad" in t and any(isinstance(d, str) for d in t["shape"])
                else ""
            )
            print(f"  {t['name']:<16} {t['dtype']:<9} [n, {', '.join(map(str, t['shape']))}]{pad}")
    n_params = sum(int(np.prod(p["shape"], dtype=np.int64)) for p in m["params"])
    print(f"params: {len(m['params'])} arrays, {n_params:,} values")
    print(
        f"devices: {len(info['devices'])} ({', '.join(info['devices'])}); loaded in "
        f"{info['load_s']:.2f} s"
    )
    _print_phases(info)
    if m.get("shapes") == "concrete":
        print(f"shapes: concrete ({len(m['programs'])} programs, one per cell)")
    groups = info.get("instances") or []
    if len(groups) > 1:
        print(f"placement: {len(groups)} instances: " + "; ".join(", ".join(g) for g in groups))
    if info.get("placement_reason"):
        print(f"  {info['placement_reason']}")
    dims = list(m.get("dim_buckets") or {})
    if dims:
        print(
            "grid: "
            + " x ".join(
                [f"batch {m['batch_buckets']}"] + [f"{d} {m['dim_buckets'][d]}" for d in dims]
            )
            + f" = {len(info['buckets'])} cells"
        )
    print(
        f"{'bucket':>7} " + "".join(f"{d:>7} " for d in dims) + f"{'per dev':>8} {'path':>6} "
        f"{'from':>8} {'compile':>9} {'exec':>9} {'GFLOP':>9} {'MB moved':>9} {'args MB':>8} "
        f"{'out MB':>7} {'temp MB':>8}"
    )
    for b in info["buckets"]:
        mem = b.get("memory", {})
        mb = lambda k, mem=mem: f"{mem[k] / 1e6:.2f}" if k in mem else "-"  # noqa: E731
        print(
            f"{b['bucket']:>7} "
            + "".join(f"{b['lengths'][d]:>7} " for d in dims)
            + f"{b['rows_per_device']:>8} "
            f"{b['path']:>6} {b['source']:>8} {b['compile_s'] * 1e3:>7.0f}ms "
            f"{b['exec_ms']:>7.2f}ms "
            f"{b.get('flops', 0) / 1e9:>9.4f} {b.get('bytes_accessed', 0) / 1e6:>9.2f} "
            f"{mb('argument_bytes'):>8} {mb('output_bytes'):>7} {mb('temp_bytes'):>8}"
        )
    return 0


def _print_phases(info: dict) -> None:
    phases = info.get("load_phases") or {}
    if phases:
        print("load: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))


def _inspect_decoder(info: dict) -> int:
    m = info["manifest"]
    d = m["decoder"]
    n_params = sum(int(np.prod(p["shape"], dtype=np.int64)) for p in m["params"])
    print(f"decoder: vocabulary {d['vocab']}, stop ids {d['stop_ids']}")
    print("cache per slot:")
    for e in d["cache"]:
        print(f"  {e['path']:<16} {e['dtype']:<9} [{', '.join(map(str, e['shape']))}]")
    print(f"params: {len(m['params'])} arrays, {n_params:,} values")
    print(
        f"devices: {len(info['devices'])} ({', '.join(info['devices'])}); loaded in "
        f"{info['load_s']:.2f} s"
    )
    _print_phases(info)
    if m.get("shapes") == "concrete":
        print(f"shapes: concrete (traced per size, for {d['num_devices']} device(s))")
    print(
        f"slots {info['slots']} x length {info['max_length']}: cache "
        f"{info['cache_bytes'] / 2**20:.2f} MiB, donated through every step and insert"
    )
    if "chunk_lengths" in d:
        print(
            f"extend: chunks of {d['chunk_lengths']} tokens, {d['chunk_batches']} rows: prompts "
            f"up to {info['max_length'] - 1} tokens (longer than the longest prefill: chunked)"
        )
    cached = info.get("prefix_cache")
    if cached:
        print(
            f"prefix cache: {cached['blocks']} blocks of {cached['block_tokens']} tokens, "
            f"{cached['pool_bytes'] / 2**20:.2f} MiB per device"
        )
    print(
        f"{'program':<16} {'batch':>6} {'length':>7} {'compile':>9} {'run':>9} {'args MB':>8} "
        f"{'temp MB':>8}"
    )
    for p in info["programs"]:
        mem = p.get("memory", {})
        mb = lambda k, mem=mem: f"{mem[k] / 1e6:.2f}" if k in mem else "-"  # noqa: E731
        took = f"{p['compile_s'] * 1e3:>7.0f}ms" if "compile_s" in p else f"{'-':>9}"
        ran = f"{p['run_ms']:>7.2f}ms" if "run_ms" in p else f"{'-':>9}"
        print(
            f"{p['program']:<16} {p.get('batch', p.get('slots')):>6} {p.get('length', '-'):>7} "
            f"{took} {ran} {mb('argument_bytes'):>8} {mb('temp_bytes'):>8}"
        )
    _print_scheduler(info.get("scheduler") or {})
    return 0


def _print_scheduler(sched: dict) -> None:
    """The scheduler's measured prices and what it chooses with them."""
    if not sched.get("priced"):
        print("scheduler: unpriced (a multi-host group): one prefill a turn, sized by the queue")
        return
    if sched.get("overlap_prefill"):
        print(
            "scheduler: prompts are prefilled on a thread of their own beside the decode "
            f"steps (overlap_prefill), {sched['in_flight']} at a time, unless one costs no "
            "more than the coming step (then between two steps), at the cells with the most "
            f"prompts per measured second (dispatch {sched['dispatch_ms']:.2f} ms a call); "
            "the first prefill of a turn:"
        )
    else:
        print(
            f"scheduler: a turn prefills within {sched['itl_bound_ms']:.2f} ms with its "
            f"decode step (itl_bound_ms), at the cells with the most prompts per measured "
            f"second (dispatch {sched['dispatch_ms']:.2f} ms a call); the first prefill of "
            "a turn:"
        )
    if sched.get("multi_step", 1) > 1:
        print(
            f"  decode steps in blocks of up to {sched['multi_step']} (multi_step) while no "
            f"prompt waits, within 2 ms at one launch ({sched['step_launch_ms']:.2f} ms "
            "measured) and each step's device time"
        )
    if sched.get("length_tiers"):
        tiers = " + ".join(f"{n} x {length}" for n, length in sched["length_tiers"])
        print(
            f"  the cache in length tiers (slots x positions): {tiers}; each prompt in the "
            "shortest free tier that holds its prompt and max_tokens"
        )
    if sched.get("auto_tiers") or sched.get("relayout"):
        print(
            "  length tiers from the traffic (length_tiers auto): "
            f"{sched.get('relayout')}; suggested: {sched.get('suggested_length_tiers', 'none yet')}"
        )
    shares = sched.get("need_shares")
    if shares:
        over = ", ".join(f"{100 * v:.1f}% over {n}" for n, v in shares.items())
        print(f"  positions the busy slots need (prompt and max_tokens): {over}")
    print(f"  {'waiting':>7} {'length':>6}   {'no slot busy':<16} every slot busy")
    for c in sched["choices"]:
        idle = f"[{c['idle'][0]}] x {c['idle'][1]}"
        busy = f"[{c['busy'][0]}] x {c['busy'][1]}"
        print(f"  {c['waiting']:>7} {c['length']:>6}   {idle:<16} {busy}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pxrt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="export the built-in demo model, load it, run it, time it")
    p.add_argument(
        "model",
        nargs="?",
        default="mlp",
        choices=("mlp", "encoder", "lm"),
        help="mlp (fixed shapes), encoder (a transformer on variable-length inputs) or lm "
        "(a decoder: generation with continuous batching)",
    )
    p.add_argument("--keep", metavar="DIR", help="export to DIR and keep it")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=40)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("export", help="export a model to an artifact directory")
    p.add_argument(
        "spec",
        help="MODULE:FUNCTION returning a dict with fn, params, inputs and "
        "optionally batch_buckets, dim_buckets, name, version (see pxrt.demo:spec, "
        "pxrt.demo:encoder_spec)",
    )
    p.add_argument("out", help="the artifact directory to write")
    p.add_argument("--buckets", help="batch buckets, comma-separated (overrides the spec's)")
    p.add_argument("--name", help="model name (overrides the spec's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing artifact")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("serve", help="serve models over HTTP (KServe v2 / Open Inference Protocol)")
    from . import serve

    serve.add_arguments(p)
    p.set_defaults(func=serve.main)

    p = sub.add_parser("bench", help="load-test a model in-process: pxrt vs naive vs ceiling")
    from .bench import command as bench

    bench.add_arguments(p)
    p.set_defaults(func=bench.main)

    p = sub.add_parser("inspect", help="load an artifact; print its manifest and buckets")
    p.add_argument("path", help="an artifact directory written by pxrt.export")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.add_argument(
        "--placement", choices=("sharded", "replicated", "auto"),
        help="load it so (auto: and say what it chose, and why)",
    )  # fmt: skip
    p.add_argument("--instances", type=int, help="replicated / auto: instances")
    p.add_argument("--devices-per-instance", type=int, help="replicated / auto: their size")
    p.add_argument(
        "--length-tiers", metavar="NxL+...",
        help="a decoder: its cache in length tiers, e.g. 20x128+10x256+2x512; auto: one "
        "cache until the traffic has sized them, then switched to while serving (the "
        "default on CPU devices at 16 slots or more); off: one cache",
    )  # fmt: skip
    p.set_defaults(func=_cmd_inspect)

    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # (pxrt serve's workers)
    try:
        return args.func(args)
    except pxrt_errors() as exc:
        print(f"pxrt: error: {exc}", file=sys.stderr)
        return 2


def pxrt_errors() -> tuple[type[BaseException], ...]:
    from pxrt import ArtifactError

    return (ArtifactError, FileNotFoundError)


if __name__ == "__main__":
    sys.exit(main())
