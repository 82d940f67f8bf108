"""What XLA:CPU's flags do to a decoder's compile and to its programs' speed.

A decoder artifact is exported once; then, for each set of ``XLA_FLAGS`` in turn (rounds
alternated), a fresh process loads it with no compilation cache, waits for every program,
and reports: the wall time to ready and to the last program, the process's CPU time, the
sum of jax's backend compiles, and the times the load measured for the programs (the
full step and the prefill cells, ``describe()``'s ``run_ms``). Ratios are against the
first flag set. ``--shape test`` is ``tests/test_generate.py``'s decoder (32 programs on
one device), the others ``benchmarks/decoder_shapes.py``'s.

On the 2-core CPU (2026-12-07), the test decoder, every program compiled: 27.1 s at
the defaults, 19.0 s with ``--xla_cpu_use_fusion_emitters=false``, 15.8 s at
``--xla_backend_optimization_level=0``, 7.3 s with both (what ``make test`` uses; CPU 52,
37, 29 and 12 s); its programs ran 1.09x, 1.89x and 1.87x the defaults' times (medians
over the step and prefill programs, as the load measured them). js-small at 16 slots
(``--shape js-small --slots 16 --requests 256 --rounds 3
--flags=";--xla_cpu_use_fusion_emitters=false"``): the older emitters compile in 0.81x
the time (25.6 against 31.4 s) but serve 0.85x the tokens/s (6,453-7,892 against
7,544-9,069 in six closed loops each): for tests, not for serving.

    python benchmarks/compile_flags.py [--shape test|demo|js-small|js-wide|keras-llama]
        [--flags=";--xla_cpu_use_fusion_emitters=false"] [--rounds 2] [--slots 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

LEVEL0 = "--xla_backend_optimization_level=0"
LOOPS = "--xla_cpu_use_fusion_emitters=false"
FLAGS = ("", LOOPS, LEVEL0, f"{LEVEL0} {LOOPS}")


def export(shape: str, directory: str, slots: int) -> str:
    if shape == "test":  # (tests/test_generate.py's lm_path)
        from pxrt import demo

        return demo.export_lm(
            os.path.join(directory, "lm"), slots=slots, max_length=64, prefill_lengths=(8, 32),
            prefill_batches=(1, 4), bounds={"length": 2048}, dim=32, heads=2, layers=2,
        )  # fmt: skip
    import decoder_shapes as ds

    model = ds.Model(ds.SHAPES[shape])
    return model.export(directory, (16, 32, 64, 128, 256), slots=slots)  # (jetstream_compare's)


def serve(dec: object, shape: str, requests: int, callers: int, rounds: int) -> list[float]:
    """Tokens/s of ``rounds`` closed loops of ``callers`` over ``requests`` of
    ``jetstream_compare.py``'s workload (fresh prompt tokens each; the first run is a
    warm-up, not counted)."""
    import asyncio

    import decoder_shapes as ds
    from generation import closed

    prompts = ds.Lengths.parse("lognormal:48:8:256")
    outputs = ds.Lengths.parse("lognormal:24:8:128")
    spec = ds.SHAPES[shape]
    work = ds.workload(requests, spec, prompts, outputs)
    rates = []
    for r in range(rounds + 1):
        got = asyncio.run(closed("pxrt", dec, ds.fresh_tokens(work, spec, r), callers))
        rates.append(got["tokens"] / got["elapsed"])
    return rates[1:]


def child(path: str, options: dict, shape: str, requests: int, callers: int) -> None:
    """One load, its figures as a JSON line on stdout."""
    import jax.monitoring

    compiles = [0.0, 0]

    def listen(event: str, seconds: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += seconds
            compiles[1] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    import pxrt

    t0, c0 = time.perf_counter(), time.process_time()
    dec = pxrt.load(path, compilation_cache=False, **options)
    ready = time.perf_counter() - t0
    dec.wait_programs(1800)
    done = time.perf_counter() - t0
    runs = {}
    for p in dec.describe()["programs"]:
        whole_step = p["program"] == "step" and "length" not in p
        if "run_ms" in p and (whole_step or p["program"] == "prefill_insert"):
            key = p["program"] + str([p.get(k) for k in ("slots", "batch", "length") if k in p])
            runs[key] = p["run_ms"]
    cpu = time.process_time() - c0
    rates = serve(dec, shape, requests, callers, 2) if requests else []
    dec.close()
    print(json.dumps({
        "ready_s": ready, "all_s": done, "cpu_s": cpu, "compile_s": compiles[0],
        "compiles": compiles[1], "run_ms": runs, "tok_s": rates,
    }))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="test")
    p.add_argument("--flags", default=";".join(FLAGS),
                   help="sets of XLA_FLAGS separated by ';' (write --flags=...)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--requests", type=int, default=0,
                   help="then closed loops over this many of jetstream_compare.py's requests "
                   "(2 after a warm-up), tokens/s")  # fmt: skip
    p.add_argument("--callers", type=int, help="the loops' callers (default --slots)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.requests and args.shape == "test":
        p.error("--requests: the workload is for decoder_shapes' shapes, not --shape test")
    if args.child:
        return child(args.child, json.loads(args.options), args.shape, args.requests,
                     args.callers or args.slots)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = export(args.shape, tmp, args.slots)
        options = {"step_lengths": [16, 32]} if args.shape == "test" else {}
        options["length_tiers"] = "off"  # (one set of programs per flag set)
        args.flags = [f.strip() for f in args.flags.split(";")]
        got: dict[str, list[dict]] = {f: [] for f in args.flags}
        for r in range(args.rounds):
            for flags in args.flags:
                env = os.environ | {"XLA_FLAGS": flags}
                out = subprocess.run(
                    [sys.executable, __file__, "--child", path, "--options", json.dumps(options),
                     "--shape", args.shape, "--requests", str(args.requests),
                     "--slots", str(args.slots), "--callers", str(args.callers or args.slots)],
                    env=env, capture_output=True, text=True, check=True,
                )  # fmt: skip
                got[flags].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {r} {flags or '(defaults)'}: {got[flags][-1]}", file=sys.stderr)
    first = args.flags[0]

    def med(flags: str, key: str, sub: str | None = None) -> float:
        return statistics.median(g[key][sub] if sub else g[key] for g in got[flags])

    print(f"{args.shape}, {args.slots} slots, medians of {args.rounds} fresh processes each")
    print(f"{'XLA_FLAGS':70s} {'ready s':>8s} {'all s':>8s} {'cpu s':>8s} {'compile s':>9s}"
          "  programs' run time / first")  # fmt: skip
    for flags in args.flags:
        runs = got[flags][0]["run_ms"]
        ratios = [med(flags, "run_ms", k) / med(first, "run_ms", k) for k in runs]
        spread = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"{flags or '(defaults)':70s} {med(flags, 'ready_s'):8.2f} {med(flags, 'all_s'):8.2f}"
              f" {med(flags, 'cpu_s'):8.1f} {med(flags, 'compile_s'):9.1f}  {spread}")  # fmt: skip
    if args.requests:
        print("tokens/s, closed loops (median; ratio to the first):")
        for flags in args.flags:
            rate = statistics.median(x for g in got[flags] for x in g["tok_s"])
            base = statistics.median(x for g in got[first] for x in g["tok_s"])
            print(f"  {flags or '(defaults)':70s} {rate:9.0f}  {rate / base:.2f}x")
    print("run_ms per program (first round):")
    for k in got[first][0]["run_ms"]:
        print(f"  {k:30s} " + "  ".join(f"{med(f, 'run_ms', k):7.3f}" for f in args.flags))


if __name__ == "__main__":
    main()
