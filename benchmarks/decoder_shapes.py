"""Decoder shapes and workloads for the generation benchmarks (``jetstream_compare.py``,
``generation.py``): one model definition that every system under test runs, so that a
comparison is of the runtimes and not of the models.

Shapes (``--shape``, each size overridable by its own flag):

- ``demo``: ``pxrt.demo``'s decoder and params as they are (2 layers, 64 wide, 4 heads,
  MLP 128, a 256-position cache of one array ``[layers, length, heads, hd]`` per slot,
  sinusoidal positions, bytes);
- ``js-small``: 2 layers, d_model 128, 4 heads, MLP 512, 512 positions, bytes (256 + BOS
  and EOS), learned positions, the cache a list per layer of ``{k, v}``, each
  ``[heads, length, head_dim]`` per slot (JetStream's engines' layout);
- ``js-wide``: as ``js-small`` with 4 layers, d_model 256, 8 heads, MLP 1024;
- ``keras-llama``: keras-hub's ``LlamaCausalLM`` (random init, rescaled so that greedy
  tokens follow the context), 2 layers, 128 wide, 4 query and 2 key/value heads, MLP
  512, a 4,096-token vocabulary, exported by ``pxrt.adapters.keras_hub``
  (``export_causal_lm``) and run everywhere else by the very functions that export
  traces (its cache is keras-hub's own, ``[layers, 2, length, kv_heads, hd]`` per slot).

The native model (every shape but ``demo`` and ``keras-llama``; ``demo`` too once a size
of it is overridden) is ``pxrt.demo``'s math with the sizes, the cache layout and the
positions as parameters: pre-norm blocks, GELU MLP, greedy-friendly random weights (the
output head scaled up as the demo's).

Workloads: prompt and output lengths as ``lognormal:MEDIAN:LOW:HIGH[:SIGMA]`` (rounded,
clipped to ``[LOW, HIGH]``; sigma 0.8 by default) or ``pareto:LOW:HIGH[:ALPHA]`` (most
short, a few long: ``pxrt.demo.token_lengths``); a prompt is clipped to leave room for the
shortest output in the cache and to the largest power of two under the cache's length (a
prefill length), and a request asks for at most what its cache has left.
Prompt tokens are printable bytes for a byte vocabulary, otherwise uniform over the
vocabulary less BOS and EOS (its last two ids). Prefill lengths are the powers of two
from 16 up to the longest prompt's (JetStream's buckets), for every system.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "jax")  # keras-llama: before keras is first imported

import pxrt  # noqa: E402
from pxrt import demo  # noqa: E402
from pxrt.specs import TensorSpec  # noqa: E402

# --------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder's sizes. ``family``: ``demo`` (``pxrt.demo`` as it is), ``native``
    (the parametrized model here) or ``keras-llama``."""

    name: str
    layers: int
    d_model: int
    heads: int
    mlp: int
    max_length: int
    vocab: int
    layout: str = "layers"  # "array": one array per slot; "layers": {k, v} per layer
    positions: str = "learned"  # or "sinusoid"
    family: str = "native"
    kv_heads: int | None = None  # keras-llama's key/value heads

    def describe(self) -> str:
        kv = f" ({self.kv_heads} kv)" if self.kv_heads else ""
        cache = {"demo": "array", "keras-llama": "keras-hub's"}.get(self.family, self.layout)
        pos = {"demo": "sinusoid", "keras-llama": "rotary"}.get(self.family, self.positions)
        return (
            f"{self.name}: {self.family}, {self.layers} layers, d_model {self.d_model}, "
            f"{self.heads} heads{kv}, MLP {self.mlp}, max_length {self.max_length}, vocab "
            f"{self.vocab}, cache {cache}, positions {pos}"
        )


SHAPES = {
    "demo": Shape(
        "demo", demo.LM_LAYERS, demo.LM_DIM, demo.LM_HEADS, 2 * demo.LM_DIM,
        demo.LM_MAX_LENGTH, demo.LM_VOCAB, "array", "sinusoid", "demo",
    ),
    "js-small": Shape("js-small", 2, 128, 4, 512, 512, 258),
    "js-wide": Shape("js-wide", 4, 256, 8, 1024, 512, 258),
    "keras-llama": Shape(
        "keras-llama", 2, 128, 4, 512, 512, 4096, family="keras-llama", kv_heads=2
    ),
}  # fmt: skip
SIZES = ("layers", "d_model", "heads", "mlp", "max_length", "vocab", "layout", "positions")


def add_shape_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model shape (a preset, then overrides)")
    g.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    g.add_argument("--layers", type=int)
    g.add_argument("--d-model", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--kv-heads", type=int, help="keras-llama only")
    g.add_argument("--mlp", type=int, help="the MLP's width")
    g.add_argument("--max-length", type=int, help="cache positions per slot")
    g.add_argument("--vocab", type=int, help="at most 32768; 258 is bytes + BOS + EOS")
    g.add_argument("--layout", choices=("array", "layers"), help="the cache (native model)")
    g.add_argument("--positions", choices=("learned", "sinusoid"), help="(native model)")


def shape_from_args(args: argparse.Namespace, name: str | None = None) -> Shape:
    """The preset ``name`` (default ``--shape``) with the flags' overrides."""
    shape = SHAPES[name or args.shape]
    changes = {k: getattr(args, k) for k in SIZES if getattr(args, k, None) is not None}
    if getattr(args, "kv_heads", None) is not None:
        changes["kv_heads"] = args.kv_heads
    if not changes:
        return shape
    if shape.family == "demo":  # pxrt.demo has no knob for these: the native model
        changes.setdefault("family", "native")
    out = dataclasses.replace(shape, **changes)
    if out.vocab > 32768 or out.vocab < 4:
        raise SystemExit(f"--vocab {out.vocab}: 4 to 32768")
    if out.d_model % out.heads:
        raise SystemExit(f"--d-model {out.d_model} is not a multiple of --heads {out.heads}")
    tag = ",".join(f"{k}={v}" for k, v in changes.items() if k != "family")
    return dataclasses.replace(out, name=f"{shape.name}[{tag}]")


# --------------------------------------------------------------------------- workloads


@dataclasses.dataclass(frozen=True)
class Lengths:
    """A length distribution: ``lognormal`` (median, sigma) or ``pareto`` (alpha),
    rounded and clipped to ``[low, high]``."""

    kind: str
    low: int
    high: int
    median: float = 0.0
    spread: float = 0.0  # lognormal's sigma, Pareto's alpha

    @classmethod
    def parse(cls, text: str) -> Lengths:
        kind, *nums = text.split(":")
        try:
            if kind == "lognormal" and len(nums) in (3, 4):
                median, low, high = float(nums[0]), int(nums[1]), int(nums[2])
                out = cls(kind, low, high, median, float(nums[3]) if len(nums) == 4 else 0.8)
            elif kind == "pareto" and len(nums) in (2, 3):
                low, high = int(nums[0]), int(nums[1])
                out = cls(kind, low, high, spread=float(nums[2]) if len(nums) == 3 else 1.2)
            else:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: lognormal:MEDIAN:LOW:HIGH[:SIGMA] or pareto:LOW:HIGH[:ALPHA]"
            ) from None
        if not 1 <= out.low <= out.high:
            raise argparse.ArgumentTypeError(f"{text!r}: want 1 <= LOW <= HIGH")
        return out

    def sample(self, n: int, seed: int, high: int | None = None) -> np.ndarray:
        high = min(self.high, high or self.high)
        if self.kind == "pareto":
            return demo.token_lengths(n, self.low, high, seed, self.spread)
        rng = np.random.default_rng(seed)
        x = rng.lognormal(math.log(self.median), self.spread, n)
        return np.clip(np.round(x), self.low, high).astype(np.int64)

    def __str__(self) -> str:
        if self.kind == "pareto":
            return f"pareto({self.low}..{self.high}, alpha {self.spread:g})"
        return f"lognormal(median {self.median:g}, sigma {self.spread:g}, {self.low}..{self.high})"


def add_workload_args(
    p: argparse.ArgumentParser,
    prompts: str = "lognormal:48:8:256",
    outputs: str = "lognormal:24:8:128",
) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--prompts", type=Lengths.parse, default=Lengths.parse(prompts),
                   help=f"prompt lengths (default {prompts})")  # fmt: skip
    g.add_argument("--outputs", type=Lengths.parse, default=Lengths.parse(outputs),
                   help=f"output lengths, max_tokens (default {outputs})")  # fmt: skip
    g.add_argument("--seed", type=int, default=0)


Work = list[tuple[np.ndarray, int]]


def max_prompt(shape: Shape, outputs: Lengths) -> int:
    """The longest prompt: room for the shortest output, and a prefill length (a power of
    two, less than max_length: JetStream truncates longer prompts, pxrt would chunk
    them)."""
    bucket = 1 << (shape.max_length - 1).bit_length() - 1
    return min(bucket, shape.max_length - outputs.low)


def workload(n: int, shape: Shape, prompts: Lengths, outputs: Lengths, seed: int = 0) -> Work:
    """``n`` (prompt, max_tokens) pairs for ``shape``: prompts clipped to
    ``max_prompt``; max_tokens at most what the cache has left."""
    plen = prompts.sample(n, seed, high=max_prompt(shape, outputs))
    olen = outputs.sample(n, seed + 1)
    rng = np.random.default_rng(seed)  # (pareto, bytes: pxrt.demo.lm_prompts's prompts)
    lo, hi = (32, 127) if shape.vocab == demo.LM_VOCAB else (1, shape.vocab - 2)
    return [
        (rng.integers(lo, hi, int(a), dtype=np.int32), int(min(b, shape.max_length - a)))
        for a, b in zip(plen, olen)
    ]


def fresh_tokens(work: Work, shape: Shape, seed: int) -> Work:
    """``work`` with the same lengths and new token ids: a run that repeats another's
    prompts would find them in pxrt's prefix cache, which a workload of distinct
    requests does not (and JetStream has none)."""
    rng = np.random.default_rng([seed, 7])
    lo, hi = (32, 127) if shape.vocab == demo.LM_VOCAB else (1, shape.vocab - 2)
    return [(rng.integers(lo, hi, len(p), dtype=np.int32), m) for p, m in work]


def prefill_lengths(work: Work, max_length: int) -> tuple[int, ...]:
    """Powers of two from 16 up to the longest prompt's bucket (JetStream's buckets;
    less than ``max_length``)."""
    longest = max(len(p) for p, _ in work)
    out = [16]
    while out[-1] < longest:
        out.append(out[-1] * 2)
    if out[-1] >= max_length:
        raise SystemExit(f"a prompt of {longest} tokens: no prefill length under {max_length}")
    return tuple(out)


def describe_work(work: Work, prompts: Lengths, outputs: Lengths) -> str:
    p = np.array([len(x) for x, _ in work])
    m = np.array([y for _, y in work])
    return (
        f"{len(work)} requests; prompts {prompts}: mean {p.mean():.0f}, p50 "
        f"{np.median(p):.0f}, max {p.max()}; outputs {outputs}: mean {m.mean():.0f}, "
        f"p50 {np.median(m):.0f}, max {m.max()} ({m.sum()} tokens at most)"
    )


# --------------------------------------------------------------------------- the native model


def _layer_norm(x, scale):
    import jax.numpy as jnp

    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * scale


def _sinusoid(at, dim: int):
    import jax.numpy as jnp

    freq = jnp.exp(-jnp.log(10000.0) * jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = at.astype(jnp.float32)[..., None] * freq
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def native_params(shape: Shape, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    d, f = shape.d_model, shape.mlp

    def dense(fan_in: int, fan_out: int) -> np.ndarray:
        return (rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)).astype(np.float32)

    params = {
        "embed": rng.standard_normal((shape.vocab, d)).astype(np.float32),
        "layers": [
            {
                "ln1": np.ones(d, np.float32),
                "qkv": dense(d, 3 * d),
                "out": dense(d, d),
                "ln2": np.ones(d, np.float32),
                "ff1": dense(d, f),
                "ff2": dense(f, d),
            }  # fmt: skip
            for _ in range(shape.layers)
        ],
        "ln_final": np.ones(d, np.float32),
        # Scaled up as the demo's: greedy decoding with clear winners.
        "head": (3.0 * rng.standard_normal((d, shape.vocab))).astype(np.float32),
    }
    if shape.positions == "learned":
        params["pos"] = (0.5 * rng.standard_normal((shape.max_length, d))).astype(np.float32)
    return params


def native_cache(shape: Shape) -> Any:
    hd = shape.d_model // shape.heads
    if shape.layout == "array":
        kv = TensorSpec((shape.layers, "length", shape.heads, hd), "float32")
        return {"k": kv, "v": kv}
    kv = TensorSpec((shape.heads, "length", hd), "float32")
    return [{"k": kv, "v": kv} for _ in range(shape.layers)]


def native_functions(shape: Shape) -> tuple[Callable, Callable, Callable]:
    """``(prefill, decode, extend)`` as ``pxrt.export_decoder`` takes them."""
    heads, dim = shape.heads, shape.d_model
    hd = dim // heads
    per_layer = shape.layout == "layers"
    scale = np.float32(1.0 / np.sqrt(hd))

    def embed(params, tokens, at):
        import jax.numpy as jnp

        x = params["embed"][tokens]
        if "pos" in params:
            return x + jnp.take(params["pos"], at, axis=0)
        return x + _sinusoid(at, dim)

    def block(layer, x, attend):
        import jax
        import jax.numpy as jnp

        h = _layer_norm(x, layer["ln1"])
        q, k, v = jnp.split(h @ layer["qkv"], 3, axis=-1)
        split = x.shape[:-1] + (heads, hd)
        out = attend(q.reshape(split), k.reshape(split), v.reshape(split))
        x = x + out.reshape(x.shape) @ layer["out"]
        h = _layer_norm(x, layer["ln2"])
        return x + jax.nn.gelu(h @ layer["ff1"]) @ layer["ff2"]

    def attention(q, k, v, keep, spec):
        import jax
        import jax.numpy as jnp

        logits = jnp.einsum(spec[0], q, k) * scale
        weights = jax.nn.softmax(jnp.where(keep, logits, -1e30), axis=-1)
        return jnp.einsum(spec[1], weights, v)

    def prefill(params, tokens, lengths):
        import jax.numpy as jnp

        b, n = tokens.shape
        seq = jnp.arange(n)
        x = embed(params, tokens, jnp.broadcast_to(seq, (b, n)))
        keep = (seq[None, :] <= seq[:, None])[None, None] & (seq < lengths[:, None])[
            :, None, None, :
        ]
        ks, vs = [], []
        for layer in params["layers"]:

            def attend(q, k, v):
                ks.append(k)
                vs.append(v)
                return attention(q, k, v, keep, ("nqhd,nkhd->nhqk", "nhqk,nkhd->nqhd"))

            x = block(layer, x, attend)
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
        logits = _layer_norm(last, params["ln_final"]) @ params["head"]
        if per_layer:  # [b, seq, heads, hd] -> [b, heads, seq, hd]
            rows = [
                {"k": k.transpose(0, 2, 1, 3), "v": v.transpose(0, 2, 1, 3)} for k, v in zip(ks, vs)
            ]
        else:
            rows = {"k": jnp.stack(ks, axis=1), "v": jnp.stack(vs, axis=1)}
        return rows, logits

    def extend(params, cache, tokens, positions):
        """``tokens [rows, k]`` at ``positions[row] + j``; decode is ``k = 1``."""
        import jax.numpy as jnp

        rows, k = tokens.shape
        at = positions[:, None] + jnp.arange(k)[None, :]  # [rows, k]
        row = jnp.arange(rows)[:, None]
        x = embed(params, tokens, at)
        if per_layer:
            cache = list(cache)
            length = cache[0]["k"].shape[2]
        else:
            kc, vc = cache["k"], cache["v"]
            length = kc.shape[2]
        keep = (jnp.arange(length)[None, None, :] <= at[:, :, None])[:, None]  # [r,1,k,len]
        for i, layer in enumerate(params["layers"]):

            def attend(q, kn, vn, i=i):
                nonlocal kc, vc
                if per_layer:  # [rows, heads, length, hd]
                    ki = cache[i]["k"].at[row, :, at].set(kn)
                    vi = cache[i]["v"].at[row, :, at].set(vn)
                    cache[i] = {"k": ki, "v": vi}
                    spec = ("rqhd,rhld->rhql", "rhql,rhld->rqhd")
                else:  # [rows, layers, length, heads, hd]
                    kc = kc.at[row, i, at].set(kn)
                    vc = vc.at[row, i, at].set(vn)
                    ki, vi = kc[:, i], vc[:, i]
                    spec = ("rqhd,rlhd->rhql", "rhql,rlhd->rqhd")
                return attention(q, ki, vi, keep, spec)

            x = block(layer, x, attend)
        logits = _layer_norm(x, params["ln_final"]) @ params["head"]
        return (cache if per_layer else {"k": kc, "v": vc}), logits

    def decode(params, cache, tokens, positions):
        cache, logits = extend(params, cache, tokens[:, None], positions)
        return cache, logits[:, 0]

    return prefill, decode, extend


# --------------------------------------------------------------------------- keras-hub's Llama


def keras_llama(shape: Shape, seed: int = 0) -> Any:
    """A random-init ``LlamaCausalLM`` of ``shape``'s sizes, greedy sampler, weights of
    unit scale (keras's tiny initializers leave greedy decoding one token repeated)."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=shape.vocab, num_layers=shape.layers, num_query_heads=shape.heads,
        num_key_value_heads=shape.kv_heads or shape.heads, hidden_dim=shape.d_model,
        intermediate_dim=shape.mlp,
    )  # fmt: skip
    lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None, name="llama")
    lm.compile(sampler="greedy")
    rng = np.random.default_rng(seed)
    for v in lm.variables:
        fan_in = v.shape[0] if len(v.shape) > 1 else 1
        v.assign(rng.standard_normal(v.shape).astype(np.float32) / np.sqrt(fan_in))
    return lm


@contextlib.contextmanager
def keras_adapter_without(step: str) -> Any:
    """pxrt's keras-hub adapter with one of its steps off while the block exports:
    ``"in_place"`` (the step's cache copies kept, ``pxrt.adapters._inplace``) or
    ``"last_logits_head"`` (every prompt position's logits): what it exported before."""
    from pxrt.adapters import keras_hub as adapter

    off = {"in_place": lambda fn, argnum: fn, "last_logits_head": lambda *a: None}[step]
    real = getattr(adapter, step)
    setattr(adapter, step, off)
    try:
        yield
    finally:
        setattr(adapter, step, real)


def least_medians(runs: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict:
    """Seconds per call of each of ``runs`` (blocking calls), alternated in ``rounds``
    (the order reversed every other round): the least of the rounds' medians of
    ``calls`` calls each (noise on a shared host only adds)."""
    best = {name: math.inf for name in runs}
    for r in range(rounds):
        for name in runs if r % 2 == 0 else list(runs)[::-1]:
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                runs[name]()
                times.append(time.perf_counter() - t0)
            best[name] = min(best[name], statistics.median(times))
    return best


# --------------------------------------------------------------------------- the model


class Model:
    """A shape's params and functions, exported once as a pxrt artifact (``export``)
    and loaded at any slot count (``load``). ``prefill``/``decode``/``extend`` are the
    functions pxrt exported: the other systems run them too."""

    def __init__(self, shape: Shape, seed: int = 0, options: dict | None = None) -> None:
        self.shape = shape
        #: pxrt's load options beyond ``slots`` (``--load KEY=VALUE``): none, the defaults.
        self.options = dict(options or {})
        self.max_length = shape.max_length
        self.vocab = shape.vocab
        self.bos, self.eos = shape.vocab - 2, shape.vocab - 1
        self.lm = None
        self.path: str | None = None
        if shape.family == "demo":
            self.params = demo.make_lm_params()
            self.cache = demo.lm_cache_spec()
            self.prefill, self.decode, self.extend = demo.lm_prefill, demo.lm_decode, demo.lm_extend
            self.bos, self.eos = demo.LM_BOS, demo.LM_EOS
        elif shape.family == "native":
            self.params = native_params(shape, seed)
            self.cache = native_cache(shape)
            self.prefill, self.decode, self.extend = native_functions(shape)
        elif shape.family == "keras-llama":
            from pxrt.adapters import keras_hub as adapter

            self.lm = keras_llama(shape, seed)
            self.params = adapter.params_of(self.lm)
            self.cache = None  # keras-hub's, known at export
            self.prefill = self.decode = self.extend = None
        else:
            raise ValueError(shape.family)

    def export(self, directory: str, prefill_lengths: Sequence[int], slots: int = 8) -> str:
        """The artifact, as pxrt's own helpers export each kind (``demo.export_lm``,
        ``adapters.keras_hub.export_causal_lm``; chunk lengths the shortest and the
        longest prefill length, prefill batches (1, 4))."""
        t0 = time.perf_counter()
        path = os.path.join(directory, self.shape.name.split("[")[0])
        lengths = tuple(prefill_lengths)
        if self.shape.family == "demo":
            self.path = demo.export_lm(
                path, slots=slots, max_length=self.max_length, prefill_lengths=lengths
            )
        elif self.shape.family == "native":
            self.path = pxrt.export_decoder(
                self.prefill, self.decode, self.params, path, cache=self.cache,
                extend=self.extend, chunk_lengths=sorted({min(lengths), max(lengths)}),
                max_length=self.max_length, slots=slots, prefill_lengths=lengths,
                prefill_batches=demo.LM_PREFILL_BATCHES, eos_id=self.eos,
                tokenizer="bytes" if self.vocab == demo.LM_VOCAB else None,
                name=self.shape.name.split("[")[0], overwrite=True,
            )  # fmt: skip
        else:
            self.path = self._export_keras(path, lengths, slots)
        self.export_s = time.perf_counter() - t0
        return self.path

    def _export_keras(self, path: str, lengths: tuple[int, ...], slots: int) -> str:
        """``export_causal_lm``, keeping the functions it hands ``export_decoder`` (its
        prefill, ``per_slot`` decode and extend, and its cache spec) for the others."""
        from unittest import mock

        from pxrt.adapters import keras_hub as adapter

        seen: dict = {}
        real = adapter.export_decoder

        def keep(prefill, decode, params, path, **options):
            seen.update(prefill=prefill, decode=decode, extend=options.get("extend"))
            seen["cache"] = options["cache"]
            return real(prefill, decode, params, path, **options)

        with mock.patch.object(adapter, "export_decoder", keep):
            out = adapter.export_causal_lm(
                self.lm, path, max_length=self.max_length, slots=slots,
                prefill_lengths=lengths, eos_id=self.eos, overwrite=True,
            )  # fmt: skip
        if not seen:
            raise RuntimeError("export_causal_lm no longer calls export_decoder: update this")
        self.prefill, self.decode, self.extend = seen["prefill"], seen["decode"], seen["extend"]
        self.cache = seen["cache"]
        return out

    def load(self, slots: int) -> Any:
        """pxrt's ``Decoder`` at ``slots`` slots, every other load option its default,
        once it has every program in use: a decoder is ready with its step and a way in
        and compiles the rest after (``Decoder.wait_programs``), which would otherwise
        run during the timed runs, on the same cores. ``load_s``: to ready; ``all_s``:
        to every program."""
        assert self.path, "export first"
        t0 = time.perf_counter()
        dec = pxrt.load(self.path, slots=slots, progress=False, **self.options)
        self.load_s = time.perf_counter() - t0
        wait = getattr(dec, "wait_programs", None)
        if wait is not None and not wait(600):
            raise RuntimeError(f"{dec!r}: its programs were not all in use after 600 s")
        if getattr(dec, "deferred_error", None) is not None:
            raise RuntimeError(f"{dec!r}: a program failed to compile") from dec.deferred_error
        self.all_s = time.perf_counter() - t0
        return dec

    def empty_cache(self, rows: int, length: int | None = None) -> Any:
        """Zeros for ``rows`` sequences of ``length`` positions (default max_length)."""
        import jax
        import jax.numpy as jnp

        from pxrt.decoder import is_spec

        n = length or self.max_length
        return jax.tree.map(
            lambda s: jnp.zeros((rows, *s.at({"length": n})), s.dtype), self.cache, is_leaf=is_spec
        )

    def put_rows(self, cache: Any, rows: Any, at: Any) -> Any:
        """``rows`` (a prefill's cache, fewer positions) into ``cache`` from row ``at``,
        position 0: ``lax.dynamic_update_slice`` per leaf."""
        import jax
        from jax import lax

        def put(c, r):
            return lax.dynamic_update_slice(c, r.astype(c.dtype), (at,) + (0,) * (c.ndim - 1))

        return jax.tree.map(put, cache, rows)


# --------------------------------------------------------------------------- keras-hub's generate


def keras_generate(model: Model, work: Work, batch: int, bucket: int = 64) -> dict:
    """keras-hub's own ``generate()`` (greedy sampler, the EOS as stop token) over the
    requests sorted by length (prompt + max_tokens), ``batch`` at a time, each batch
    padded to a multiple of ``bucket`` positions (keras-hub compiles per shape; every
    shape is compiled before the clock starts). A batch runs until its every row has
    stopped or it reached its length. Returns the tokens per request (cut at its
    max_tokens and after its EOS), their count, and the time."""
    lm = model.lm
    order = sorted(range(len(work)), key=lambda i: (len(work[i][0]) + work[i][1], i))
    groups = [order[i : i + batch] for i in range(0, len(order), batch)]
    stops = (model.eos,)

    def inputs(group):
        need = max(len(work[i][0]) + work[i][1] for i in group)
        n = min(-(-need // bucket) * bucket, model.max_length)
        tokens = np.zeros((batch, n), np.int32)
        mask = np.zeros((batch, n), bool)
        for row, i in enumerate(group + group[:1] * (batch - len(group))):  # a full batch
            p = work[i][0]
            tokens[row, : len(p)] = p
            mask[row, : len(p)] = True
        return {"token_ids": tokens, "padding_mask": mask}

    batches = [inputs(g) for g in groups]
    for n in sorted({b["token_ids"].shape[1] for b in batches}):  # compile every shape
        warm = next(b for b in batches if b["token_ids"].shape[1] == n)
        lm.generate(dict(warm), stop_token_ids=stops)
    outputs: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    raw = [np.asarray(lm.generate(dict(b), stop_token_ids=stops)["token_ids"]) for b in batches]
    elapsed = time.perf_counter() - t0
    for group, out in zip(groups, raw):
        for row, i in enumerate(group):
            p, m = work[i]
            row_tokens = out[row, len(p) : len(p) + m].tolist()
            if model.eos in row_tokens:
                row_tokens = row_tokens[: row_tokens.index(model.eos) + 1]
            outputs[i] = row_tokens
    tokens = sum(map(len, outputs.values()))
    return {
        "outputs": outputs,
        "tokens": tokens,
        "elapsed": elapsed,
        "tok/s": tokens / elapsed,
        "batches": len(batches),
        "shapes": len({b["token_ids"].shape[1] for b in batches}),
    }


def compare_tokens(want: dict[int, list[int]], got: dict[int, list[int]]) -> tuple[int, list[str]]:
    """How many requests of ``want`` (pxrt's) ``got`` gives token for token, and a line
    per difference."""
    same, lines = 0, []
    for i, x in want.items():
        y = got[i]
        if x == y:
            same += 1
            continue
        at = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        lines.append(
            f"  MISMATCH request {i}: pxrt {len(x)} tokens, the other {len(y)}; first "
            f"difference at token {at}: {x[at : at + 5]} vs {y[at : at + 5]}"
        )
    return same, lines
