"""Start-up times as a user meets them: every figure from a fresh process, cold against
warm, and this tree against an earlier revision side by side.

Rows (each run in its own process, the trees alternated, medians of ``--repeats``):

- ``import``: ``python -c "import pxrt.executable, jax; jax.devices()"``, process wall time;
- ``cold load``: ``pxrt.load`` with an empty cache directory (the load's own time: for a
  decoder, until it serves); ``cold, all``: until a decoder's programs compiled after
  it is ready are in use too (the same as ``cold load`` for a one-shot model, or a
  tree that compiles them all first);
- ``warm load``: ``pxrt.load`` again, with the cache the cold load left;
- ``serve ready``: ``pxrt serve ARTIFACT`` with that warm cache, from the spawn until
  ``/v2/health/ready`` answers 200 (process wall time);
- ``reload``: a model of a repository served by ``pxrt serve --model-control-mode
  explicit``, unloaded and loaded again through the repository API (warm): the time of
  the load call;
- ``ray replica`` (``--ray``): ``serve.run`` of a one-replica pxrt application with a warm
  cache, until the replica is ready.

``--baseline REV`` checks REV out into a temporary git worktree and runs the same rows
with it (its Cython extensions copied from this tree when their sources are the same,
else both trees run with ``PXRT_NO_EXTENSIONS=1``). Each tree has its own cache
directories.

    python benchmarks/load_times.py [--model encoder|mlp|lm|keras-llama] [--repeats 3]
        [--baseline REV] [--ray]
"""

from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

LOAD = """
import json, sys, time
import pxrt
t0 = time.perf_counter()
m = pxrt.load(sys.argv[1], progress=False)
t1 = time.perf_counter()
if hasattr(m, "wait_programs"):  # (a decoder's programs compiled after it is ready)
    m.wait_programs()
print("RESULT", json.dumps({"load_s": t1 - t0, "all_s": time.perf_counter() - t0,
                            "phases": getattr(m, "load_phases", {})}))
"""

RAY = """
import json, sys, time
import ray
from ray import serve
from serving.ray import pxrt_app
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
out = []
for i in range(int(sys.argv[2]) + 1):  # the first fills the cache
    t0 = time.perf_counter()
    serve.run(pxrt_app(sys.argv[1], num_replicas=1, ray_actor_options={"num_cpus": 0}),
              name="m", route_prefix="/m")
    out.append(time.perf_counter() - t0)
    serve.delete("m")
print("RESULT", json.dumps(out[1:]), flush=True)
serve.shutdown()
"""


class Tree:
    """A source tree to run pxrt from, with its own cache directories."""

    def __init__(self, label: str, root: str, env: dict[str, str]) -> None:
        self.label = label
        self.root = root
        self.env = env
        self.caches: list[str] = []

    def fresh_cache(self) -> str:
        path = tempfile.mkdtemp(prefix=f"pxrt-load-{self.label}-")
        self.caches.append(path)
        return path

    def environ(self, cache: str) -> dict[str, str]:
        return dict(os.environ, **self.env, PXRT_CACHE_DIR=cache, PYTHONPATH=self.root)

    def python(self, code: str, *args: str, cache: str, timeout: float = 600) -> str:
        done = subprocess.run(
            [sys.executable, "-c", code, *args],
            cwd=self.root,
            env=self.environ(cache),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode:
            raise RuntimeError(f"{self.label}: {done.stderr[-2000:]}")
        results = [ln[7:] for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        return results[-1] if results else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str, method: str = "GET", timeout: float = 120) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=b"{}" if method == "POST" else None)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def serve_ready(tree: Tree, args: list[str], cache: str) -> tuple[subprocess.Popen, float, int]:
    """Start ``pxrt serve``; (process, seconds from spawn to ready, port)."""
    port = free_port()
    cmd = [sys.executable, "-c", "from serving.cli import main; main()", "serve", *args]
    cmd += ["--port", str(port), "--host", "127.0.0.1"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=tree.root, env=tree.environ(cache), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{tree.label}: pxrt serve exited: {proc.stderr.read()[-2000:]!r}")
        try:
            if get(port, "/v2/health/ready", timeout=1) == 200:
                return proc, time.perf_counter() - t0, port
        except OSError:
            pass
        time.sleep(0.005)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure(tree: Tree, artifact: str, repository: str, name: str, ray_runs: int) -> dict:
    """One round of every row for ``tree``."""
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    tree.python("import pxrt.executable, jax; jax.devices()", cache=tree.fresh_cache())
    out["import"] = time.perf_counter() - t0
    cache = tree.fresh_cache()
    cold = json.loads(tree.python(LOAD, artifact, cache=cache))
    warm = json.loads(tree.python(LOAD, artifact, cache=cache))
    out["cold load"], out["warm load"] = cold["load_s"], warm["load_s"]
    out["cold, all"] = cold.get("all_s", cold["load_s"])
    out["phases"] = warm["phases"]  # type: ignore[assignment]
    proc, out["serve ready"], _ = serve_ready(tree, [artifact], cache)
    stop(proc)
    proc, _, port = serve_ready(
        tree,
        ["--model-repository", repository, "--model-control-mode", "explicit",
         "--load-model", name],
        cache,
    )  # fmt: skip
    try:
        assert get(port, f"/v2/repository/models/{name}/unload", "POST") == 200
        t0 = time.perf_counter()
        assert get(port, f"/v2/repository/models/{name}/load", "POST") == 200
        out["reload"] = time.perf_counter() - t0
    finally:
        stop(proc)
    if ray_runs:
        out["ray replica"] = statistics.median(
            json.loads(tree.python(RAY, artifact, str(ray_runs), cache=cache, timeout=900))
        )
    return out


def baseline_tree(rev: str, env: dict[str, str]) -> tuple[Tree, str]:
    where = tempfile.mkdtemp(prefix="pxrt-baseline-")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", where, rev], check=True,
                   capture_output=True)  # fmt: skip
    same = (
        subprocess.run(
            ["git", "-C", ROOT, "diff", "--quiet", rev, "--", "*.pyx", "*.pxd"]
        ).returncode
        == 0
    )
    if same:
        for so in glob.glob(os.path.join(ROOT, "*", "*.so")):
            shutil.copy(so, os.path.join(where, os.path.relpath(so, ROOT)))
    else:
        env["PXRT_NO_EXTENSIONS"] = "1"
    return Tree(rev, where, env), where


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("encoder", "mlp", "lm", "keras-llama"), default="encoder")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", metavar="REV", help="a git revision to compare with")
    p.add_argument("--ray", action="store_true", help="also a Ray Serve replica's start")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    from pxrt import demo

    work = tempfile.mkdtemp(prefix="pxrt-load-times-")
    repository = os.path.join(work, "repo")
    artifact = os.path.join(repository, args.model, "1")
    if args.model == "keras-llama":  # (benchmarks/decoder_shapes.py's, exported as it does)
        sys.path.insert(0, HERE)
        from decoder_shapes import SHAPES, Model

        model = Model(SHAPES["keras-llama"])
        built = model.export(os.path.dirname(artifact), prefill_lengths=(16, 32, 64, 128))
        os.rename(built, artifact)
    else:
        export = {"encoder": demo.export_encoder, "mlp": demo.export_demo, "lm": demo.export_lm}
        export[args.model](artifact)
    env: dict[str, str] = {}
    trees = [Tree("this tree", ROOT, env)]
    worktree = None
    if args.baseline:
        base, worktree = baseline_tree(args.baseline, env)
        trees.insert(0, base)
    rows: dict[str, dict[str, list]] = {t.label: {} for t in trees}
    try:
        for r in range(args.repeats):
            for tree in trees if r % 2 == 0 else trees[::-1]:
                got = measure(tree, artifact, repository, args.model, 2 if args.ray else 0)
                for k, v in got.items():
                    rows[tree.label].setdefault(k, []).append(v)
                print(f"round {r + 1}, {tree.label}: " + ", ".join(
                    f"{k} {v:.2f} s" for k, v in got.items() if isinstance(v, float)
                ), flush=True)  # fmt: skip
    finally:
        for tree in trees:
            for c in tree.caches:
                shutil.rmtree(c, ignore_errors=True)
        if worktree:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", worktree],
                           capture_output=True)  # fmt: skip
        shutil.rmtree(work, ignore_errors=True)

    med = {t: {k: statistics.median(v) for k, v in r.items() if k != "phases"}
           for t, r in rows.items()}  # fmt: skip
    names = [k for k in med[trees[-1].label]]
    print(f"\n{args.model}, medians of {args.repeats} fresh processes (seconds)")
    head = f"{'':<13}" + "".join(f"{t.label:>14}" for t in trees)
    head += f"{'after/before':>14}" if len(trees) == 2 else ""
    print(head)
    for k in names:
        line = f"{k:<13}" + "".join(f"{med[t.label].get(k, float('nan')):>14.2f}" for t in trees)
        if len(trees) == 2:
            line += f"{med[trees[1].label][k] / med[trees[0].label][k]:>13.2f}x"
        print(line)
    for t in trees:
        m = med[t.label]
        print(
            f"{t.label}: warm/cold load {m['warm load'] / m['cold load']:.2f}x, "
            f"serve ready / import {m['serve ready'] / m['import']:.2f}x; warm phases "
            f"{rows[t.label]['phases'][-1]}"
        )


if __name__ == "__main__":
    main()
