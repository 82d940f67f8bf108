"""(temporary) where a masked step's host time goes: the loop's methods timed."""
import collections, os, sys, time
sys.path.insert(0, "benchmarks")
import numpy as np
from pxrt.decoder import runner, loop, grammar, engine
T = collections.Counter(); N = collections.Counter()
def wrap(cls, name):
    f = getattr(cls, name)
    def w(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally:
            T[name] += time.perf_counter() - t; N[name] += 1
    setattr(cls, name, w)
R = runner.Runner
for n in ("_peek_grammars", "_dispatch_split", "_read", "_advance_grammars", "_launch", "_forward_now", "_dispatch_step", "_admit", "_prefill", "_extend", "_drafts"):
    if hasattr(R, n): wrap(R, n)
    else:
        for c in type.mro(engine.Decoder):
            if n in c.__dict__: wrap(c, n); break
for n in ("masks", "consume", "take"): wrap(grammar.Grammars, n)
launch = R._launch
def launch2(self, index, program, *args):
    host = any(isinstance(a, np.ndarray) for a in args)
    t = time.perf_counter()
    try: return launch(self, index, program, *args)
    finally:
        key = "launch/host-args" if host else "launch/device-args"
        T[key] += time.perf_counter() - t; N[key] += 1
R._launch = launch2
import tpu_structured  # noqa: runs
