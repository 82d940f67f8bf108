"""Multi-host lockstep overhead: one batch on a group of 2 processes x 2 virtual CPU
devices (pxrt.multihost, gloo, loopback) against the same batch on one process with 4
devices (the same SPMD program per device), alternated, medians of rounds; where the
group's time goes (sending the header and rows, waiting for the follower's answer
after the leader's own shards are on the host); and the data paths it could have used,
measured as raw jax programs on the same group: outputs kept sharded by rows (pxrt's),
outputs replicated by the program (an all-gather over gloo), and Saxml's leader data
plus zeros summed in the program (an all-reduce).

Models: a near-empty one (x * 2: the lockstep alone) and an MLP 256 -> 1024 -> 1024 ->
256 (gelu), buckets 8 and 256, full batches; the MLP served to 64 callers
(``serving.Server``); then the demo decoder's decode steps.

    python benchmarks/multihost.py [--rounds 5] [--iters 200] [--sizes 8,256]
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

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


# --------------------------------------------------------------------------- roles


def _clocked(fn, spent: dict, key: str):
    """``fn``, adding the seconds each call takes to ``spent[key]``."""

    def call(*args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            spent[key] += time.perf_counter() - t

    return call


def _timed(model, rows: int, iters: int) -> dict:
    """Median microseconds of ``model.run`` of a full ``rows``-row batch, and of the
    group's send and wait per batch (0 in one process)."""
    group = model.group
    spent = {"send": 0.0, "wait": 0.0}
    if group is not None:
        group.send = _clocked(group.send, spent, "send")
        group.wait = _clocked(group.wait, spent, "wait")
    x = np.random.default_rng(rows).standard_normal((rows, 256)).astype(np.float32)
    for _ in range(10):
        model.run({"x": x})
    spent.update(send=0.0, wait=0.0)  # (in place: the clocks hold this dict)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        model.run({"x": x})
        times.append(time.perf_counter() - t)
    if group is not None:
        del group.send, group.wait
    return {
        "median_us": statistics.median(times) * 1e6,
        "send_us": spent["send"] / iters * 1e6,
        "wait_us": spent["wait"] / iters * 1e6,
    }


def _decode_steps(decoder, slots: int, tokens: int) -> dict:
    """Median seconds between decode steps, every slot busy for ``tokens`` steps."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, 6).astype(np.int32) for _ in range(slots)]
    for g in [decoder.submit(p, max_tokens=8) for p in prompts]:  # warm
        g.result(120)
    decoder.drain_timings()
    for g in [decoder.submit(p, max_tokens=tokens) for p in prompts]:
        g.result(300)
    steps = decoder.drain_timings()["step"]
    return {"median_us": statistics.median(steps) * 1e6, "send_us": 0.0, "wait_us": 0.0}


def _serve_rate(model, callers: int, seconds: float) -> dict:
    """Requests per second through ``serving.Server`` (dynamic batching), ``callers``
    closed-loop callers of 1-row requests for ``seconds``."""
    import asyncio
    import functools

    from serving import Server
    from serving.bench.loadgen import closed_loop

    async def go() -> dict:
        async with Server() as server:
            server.add_model("m", model)
            infer = functools.partial(server.infer, "m")
            x = {"x": np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)}
            await closed_loop(infer, x, callers, 0.3)  # warm
            lat, elapsed, _ = await closed_loop(infer, x, callers, seconds)
        return {"median_us": len(lat) / elapsed, "p50_ms": statistics.median(lat) * 1e3}

    return asyncio.run(go())


def _serve_commands(model) -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        kind, a, b = line.split()
        if kind == "serve":  # (median_us: req/s here)
            print(json.dumps(_serve_rate(model, int(a), float(b))), flush=True)
        elif hasattr(model, "drain_timings"):  # a decoder: a is its slots
            print(json.dumps(_decode_steps(model, int(a), int(b))), flush=True)
        else:
            print(json.dumps(_timed(model, int(a), int(b))), flush=True)
    model.close()


def _role(args: argparse.Namespace) -> None:
    import pxrt
    from pxrt.multihost import Distributed, Follower

    if args.role == "single":
        _serve_commands(pxrt.load(args.artifact, progress=False))
        return
    cfg = Distributed(args.coordinator, 2, args.process_id, control_port=args.control_port)
    if args.role == "paths":
        _data_paths(cfg, args)
        return
    loaded = pxrt.load(args.artifact, distributed=cfg, progress=False)
    if isinstance(loaded, Follower):
        loaded.follow()
        return
    _serve_commands(loaded)


def _data_paths(cfg, args: argparse.Namespace) -> None:
    """Raw jax on the group (every process runs the same loop): the step time of the
    MLP with row-sharded outputs, with replicated outputs, and Saxml's way (every
    process holds the whole batch, zeros but the leader's; a psum makes the batch)."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pxrt import multihost

    multihost.initialize(cfg)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows_sh, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    params = jax.device_put(_params(), rep)

    def saxml(p, x):  # x: the whole batch on every device; zeros but the leader's
        return _mlp(p, jax.lax.psum(x, "data"))

    results = {}
    for size in args.sizes:
        x = np.random.default_rng(size).standard_normal((size, 256)).astype(np.float32)
        layout = multihost.Layout.of(rows_sh, size, jax.process_index())
        mine = layout.rows[jax.process_index()]
        local_x = x[mine]
        variants = {
            "rows out": (jax.jit(_mlp, out_shardings=rows_sh), rows_sh, True),
            "replicated out": (jax.jit(_mlp, out_shardings=rep), rows_sh, True),
        }
        shard_map = jax.shard_map(
            saxml, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False
        )
        variants["leader data + zeros, psum"] = (jax.jit(shard_map), rep, False)
        for name, (fn, in_sh, sharded_in) in variants.items():
            whole = x if jax.process_index() == 0 else np.zeros_like(x)
            if sharded_in:
                arrays = multihost._global_arrays([local_x], size, in_sh)[0]
            else:
                share = whole / len(jax.local_devices())  # the psum adds every device's
                arrays = jax.make_array_from_single_device_arrays(
                    x.shape, in_sh, [jax.device_put(share, d) for d in jax.local_devices()]
                )
            times = []
            for i in range(args.iters + 10):
                t = time.perf_counter()
                out = fn(params, arrays)
                for s in out.addressable_shards:
                    np.asarray(s.data)
                if i >= 10:
                    times.append(time.perf_counter() - t)
            results[f"{name} @ {size}"] = statistics.median(times) * 1e6
    if jax.process_index() == 0:
        print(json.dumps(results), flush=True)
        time.sleep(2)  # the follower leaves jax's runtime while its service still runs
    else:
        multihost._leave_group()


def _params(seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    dims = (256, 1024, 1024, 256)
    return [
        ((rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32), np.zeros(b, np.float32))
        for a, b in zip(dims, dims[1:])
    ]


# --------------------------------------------------------------------------- driver


def _spawn(role: str, devices: int, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.Popen(
        [sys.executable, __file__, "--role", role, *extra],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=None if os.environ.get("PXRT_BENCH_VERBOSE") else subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )


def _ask(proc: subprocess.Popen, command: str) -> dict:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit("a process stopped answering (PXRT_BENCH_VERBOSE=1 shows why)")


def _measure(
    artifact: str,
    args: argparse.Namespace,
    sizes: list[int] | None = None,
    iters: float = 0,
    command: str = "run",
) -> dict[tuple[str, int], list[dict]]:
    """A group and one process loading ``artifact``, asked in turn, round by round:
    ``command size iters`` for each size (``run``: batches of ``size`` rows, ``iters``
    times; ``serve``: ``size`` callers for ``iters`` seconds)."""
    sizes = sizes or args.sizes
    iters = iters or args.iters
    coordinator, control = _free_ports(2)
    group = [
        _spawn(role, 2, "--artifact", artifact, "--coordinator", f"127.0.0.1:{coordinator}",
               "--control-port", str(control), "--process-id", str(pid))
        for pid, role in enumerate(("leader", "follower"))
    ]  # fmt: skip
    single = _spawn("single", 4, "--artifact", artifact)
    for proc in (group[0], single):
        assert proc.stdout is not None
        for line in proc.stdout:  # (past anything a library printed first)
            if line.strip() == "ready":
                break
        else:
            raise SystemExit("a process did not load (PXRT_BENCH_VERBOSE=1 shows why)")
    got: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        for rows in sizes:
            order = [("group", group[0]), ("one process", single)]
            for name, proc in order if r % 2 == 0 else order[::-1]:
                got.setdefault((name, rows), []).append(_ask(proc, f"{command} {rows} {iters}"))
    for proc in (group[0], single):
        assert proc.stdin is not None
        proc.stdin.close()
    for proc in (*group, single):
        proc.wait(60)
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--sizes", default="8,256")
    p.add_argument("--role", help=argparse.SUPPRESS)
    p.add_argument("--artifact", help=argparse.SUPPRESS)
    p.add_argument("--coordinator", help=argparse.SUPPRESS)
    p.add_argument("--control-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if args.role:
        _role(args)
        return

    import pxrt

    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "scale (x * 2: the lockstep alone)": (
                lambda params, x: {"y": x * params},
                np.float32(2),
            ),
            "MLP 256-1024-1024-256": (lambda params, x: {"y": _mlp(params, x)}, _params()),
        }
        print(f"Lockstep overhead: 2 processes x 2 devices vs 1 process x 4 devices, full "
              f"batches, medians of {args.rounds} rounds x {args.iters} runs; send: the "
              "header and rows to the follower; wait: from the leader's own launch until "
              "every follower answered")  # fmt: skip
        artifact = ""
        for title, (fn, params) in models.items():
            artifact = pxrt.export(
                fn,
                params,
                os.path.join(tmp, f"m{len(title)}"),
                inputs={"x": pxrt.TensorSpec((256,), "float32")},
                batch_buckets=tuple(args.sizes),
                name="m",
            )
            got = _measure(artifact, args)
            print(f"\n{title}")
            print(f"{'batch':>6} {'one process':>12} {'group':>9} {'ratio':>6} {'overhead':>9} "
                  f"{'send':>7} {'wait':>7}")  # fmt: skip
            for rows in args.sizes:
                one = statistics.median(g["median_us"] for g in got[("one process", rows)])
                grp = statistics.median(g["median_us"] for g in got[("group", rows)])
                send = statistics.median(g["send_us"] for g in got[("group", rows)])
                wait = statistics.median(g["wait_us"] for g in got[("group", rows)])
                print(f"{rows:>6} {one:>10.0f}us {grp:>7.0f}us {grp / one:>5.2f}x "
                      f"{grp - one:>7.0f}us {send:>5.0f}us {wait:>5.0f}us")  # fmt: skip

        got = _measure(artifact, args, sizes=[64], iters=3.0, command="serve")
        one = statistics.median(g["median_us"] for g in got[("one process", 64)])
        grp = statistics.median(g["median_us"] for g in got[("group", 64)])
        print(f"\nServing the MLP (serving.Server, 64 closed-loop callers of 1-row requests, "
              f"3 s): one process {one:.0f} req/s, group {grp:.0f} req/s, "
              f"{grp / one:.2f}x")  # fmt: skip

        from pxrt import demo

        lm = demo.export_lm(
            os.path.join(tmp, "lm"), slots=4, max_length=160, prefill_lengths=(8,),
            prefill_batches=(4,), dim=64, heads=2, layers=2,
        )  # fmt: skip
        got = _measure(lm, args, sizes=[4], iters=128)
        one = statistics.median(g["median_us"] for g in got[("one process", 4)])
        grp = statistics.median(g["median_us"] for g in got[("group", 4)])
        print(f"\nDecode steps (demo decoder, dim 64, 2 layers, 4 slots all busy, 128 tokens "
              f"each), median interval between steps: one process {one:.0f}us, group "
              f"{grp:.0f}us, {grp / one:.2f}x (each device steps its own slots; the group's "
              "followers send the leader their slots' tokens)")  # fmt: skip

        coordinator, control = _free_ports(2)
        sizes = ",".join(map(str, args.sizes))
        paths = [
            _spawn("paths", 2, "--coordinator", f"127.0.0.1:{coordinator}", "--control-port",
                   str(control), "--process-id", str(pid), "--sizes", sizes)
            for pid in range(2)
        ]  # fmt: skip
        assert paths[0].stdout is not None
        line = next(line for line in paths[0].stdout if line.startswith("{"))
        for proc in paths:
            proc.wait(120)
        results = json.loads(line)
        print("\nData paths, raw jax on the same group (median step, both processes):")
        for rows in args.sizes:
            base = results[f"rows out @ {rows}"]
            for name in ("rows out", "replicated out", "leader data + zeros, psum"):
                us = results[f"{name} @ {rows}"]
                print(f"  batch {rows:>4} {name:<27} {us:>7.0f}us  {us / base:>5.2f}x")


def _mlp(params, x):
    import jax

    for w, b in params:
        x = jax.nn.gelu(x @ w + b)
    return x


if __name__ == "__main__":
    main()
