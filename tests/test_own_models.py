"""Models written the way library code is: a learned position table sliced to the
sequence length, a per-position bias over the cache. They export with pxrt's default
bounds (``seq <= largest bucket``), run equal to plain JAX, and say what to do when a
bound is missing. Artifacts are reproducible: the same model exported from two scripts
gives the same bytes and the second load runs the first one's stored executables. A
decoder without a tokenizer answers OpenAI's completions with token ids."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pxrt
from pxrt.shapes import ExportError

TABLE = 40  # rows of the position tables: what a checkpoint would fix
DIM, VOCAB = 16, 64
LENGTHS = (8, 16)
MAX_LENGTH = 32


def make_params(seed=0):
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.3):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    return {
        "embed": w(VOCAB, DIM, scale=1.0),
        "pos": w(TABLE, DIM),
        "bias": w(TABLE),
        "q": w(DIM, DIM),
        "k": w(DIM, DIM),
        "v": w(DIM, DIM),
        "head": w(DIM, VOCAB, scale=2.0),
    }


# --------------------------------------------------------------------------- one-shot


def tagger(params, tokens):
    """Per-token outputs with a learned position embedding, as a BERT-style encoder
    adds one: the fixed table sliced to the sequence length."""
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    return {"y": jnp.tanh(x @ params["q"])}


def test_a_position_table_exports_bounded_and_runs_like_jax(tmp_path):
    params = make_params()
    inputs = {"tokens": pxrt.TensorSpec(("seq",), "int32")}
    path = pxrt.export(
        tagger, params, tmp_path / "tagger", inputs=inputs, batch_buckets=(4,),
        dim_buckets={"seq": LENGTHS},
    )  # fmt: skip
    manifest = json.loads((tmp_path / "tagger" / "manifest.json").read_text())
    assert manifest["bounds"] == {"seq": max(LENGTHS)}
    model = pxrt.load(path)
    rng = np.random.default_rng(1)
    for n in (3, 8, 11, 16):
        tokens = rng.integers(0, VOCAB, (2, n), dtype=np.int32)
        got = model.run({"tokens": tokens})["y"]
        np.testing.assert_allclose(got, jax.jit(tagger)(params, tokens)["y"], atol=1e-6)
    model.close()
    # The bound is the program's: load refuses lengths beyond it, naming it.
    with pytest.raises(ValueError, match=r"'seq' lengths \[32\] are over 16.*seq <= 16"):
        pxrt.load(path, dim_buckets={"seq": (8, 32)})


def test_without_a_bound_export_says_which_dimension_and_what_helps(tmp_path):
    inputs = {"tokens": pxrt.TensorSpec(("seq",), "int32")}
    with pytest.raises(ExportError) as info:
        pxrt.export(
            tagger, make_params(), tmp_path / "t", inputs=inputs, dim_buckets={"seq": LENGTHS},
            bounds={"seq": None},
        )  # fmt: skip
    text = str(info.value)
    assert "seq (unbounded)" in text and "b (batch)" in text and "bounds=" in text, text
    # A bound past the table is no better, and the message gives the bound it had.
    with pytest.raises(ExportError, match=r"seq <= 64"):
        pxrt.export(
            tagger, make_params(), tmp_path / "t", inputs=inputs, dim_buckets={"seq": LENGTHS},
            bounds={"seq": 64},
        )  # fmt: skip
    # jax's own constraints pass through (here: the table's size).
    pxrt.export(
        tagger, make_params(), tmp_path / "t", inputs=inputs, dim_buckets={"seq": LENGTHS},
        bounds={"seq": None}, constraints=(f"seq <= {TABLE}",),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"bounds\['seq'\] is 10 but 'seq' is compiled at 16"):
        pxrt.export(
            tagger, make_params(), tmp_path / "t", inputs=inputs, dim_buckets={"seq": LENGTHS},
            bounds={"seq": 10},
        )  # fmt: skip


def looped(params, tokens):
    """Python over the shapes, as library code has it: the batch's ``len`` and a loop
    over it (no symbol can be a ``range``)."""
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    firsts = jnp.stack([x[i, 0] for i in range(len(tokens))])
    return {"first": firsts @ params["q"], "y": jnp.tanh(x)}


def test_code_that_needs_ints_exports_with_concrete_shapes(tmp_path):
    params = make_params(4)
    inputs = {"tokens": pxrt.TensorSpec(("seq",), "int32")}
    grid = dict(inputs=inputs, batch_buckets=(4, 8), dim_buckets={"seq": LENGTHS})
    with pytest.raises(ExportError, match="shapes='concrete'"):
        pxrt.export(looped, params, tmp_path / "sym", **grid)
    path = pxrt.export(looped, params, tmp_path / "looped", shapes="concrete", **grid)
    manifest = json.loads((tmp_path / "looped" / "manifest.json").read_text())
    assert manifest["shapes"] == "concrete" and manifest["format_version"] == 5
    assert sorted(p["cell"] for p in manifest["programs"]) == [
        [b, n] for b in (4, 8) for n in LENGTHS
    ]
    assert manifest["outputs"] == [
        {"name": "first", "dtype": "float32", "shape": [DIM]},
        {"name": "y", "dtype": "float32", "shape": ["seq", DIM]},
    ]
    reference = jax.jit(looped)
    with pxrt.load(path) as model:  # every cell: the batch splits over 1 or 4 devices
        rng = np.random.default_rng(5)
        for rows, n in ((1, 3), (3, 16), (6, 9), (8, 8)):
            tokens = rng.integers(0, VOCAB, (rows, n), dtype=np.int32)
            got, want = model.run({"tokens": tokens}), reference(params, tokens)
            for k in ("first", "y"):
                np.testing.assert_allclose(got[k], want[k], atol=1e-6, err_msg=k)
    with pytest.raises(ValueError, match=r"shapes='concrete'.*not \[\(8, 12\)\]"):
        pxrt.load(path, buckets=(8,), dim_buckets={"seq": (12,)})


def test_flax_linen_and_nnx_modules_export_as_they_are(tmp_path):
    """The recipes of docs/bring-your-own-model.md: the weights as params, the module
    closed over; outputs equal the module's own."""
    from flax import linen, nnx

    class Tagger(linen.Module):
        @linen.compact
        def __call__(self, tokens):
            x = linen.Embed(VOCAB, DIM)(tokens)
            pos = self.param("pos", linen.initializers.normal(0.1), (TABLE, DIM))
            return linen.Dense(DIM)(jax.nn.gelu(x + pos[: tokens.shape[1]]))

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(DIM, 32, rngs=rngs), nnx.Linear(32, 8, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    rng = np.random.default_rng(6)
    linen_model = Tagger()
    tokens = rng.integers(0, VOCAB, (3, 11), dtype=np.int32)
    variables = linen_model.init(jax.random.key(0), tokens)
    path = pxrt.export(
        lambda params, tokens: linen_model.apply({"params": params}, tokens),
        variables["params"], tmp_path / "linen", batch_buckets=(4,), dim_buckets={"seq": LENGTHS},
        inputs={"tokens": pxrt.TensorSpec(("seq",), "int32")},
    )  # fmt: skip
    with pxrt.load(path) as model:
        np.testing.assert_allclose(
            model.run({"tokens": tokens})["output"], linen_model.apply(variables, tokens),
            atol=1e-5,
        )  # fmt: skip

    graphdef, state = nnx.split(Mlp(nnx.Rngs(0)), nnx.Param)
    path = pxrt.export(
        lambda state, x: nnx.merge(graphdef, state)(x), state, tmp_path / "nnx",
        batch_buckets=(4,), inputs={"x": pxrt.TensorSpec((DIM,), "float32")},
    )  # fmt: skip
    x = rng.standard_normal((5, DIM)).astype(np.float32)
    with pxrt.load(path) as model:
        np.testing.assert_allclose(
            model.run({"x": x})["output"], nnx.merge(graphdef, state)(x), atol=1e-5
        )


# --------------------------------------------------------------------------- reproducible

EXPORT_SCRIPT = """
import pxrt
path = pxrt.export(
    tagger, params, out, inputs={{"tokens": pxrt.TensorSpec(("seq",), "int32")}},
    batch_buckets=(4,), dim_buckets={{"seq": {lengths}}},
)
"""


def test_the_same_model_from_two_scripts_is_the_same_artifact(tmp_path):
    """Two scripts (their own files and lines) export the same function and params:
    the directories are byte for byte the same, and loading the second runs the
    executables the first one's load stored."""
    from pxrt import _xla

    params = make_params(3)
    outs = []
    for i, pad in enumerate(("", "\n\n\n# another script, other lines\n")):
        script = tmp_path / f"export_{i}.py"
        script.write_text(pad + EXPORT_SCRIPT.format(lengths=LENGTHS))
        out = str(tmp_path / f"script{i}" / "tagger")
        code = compile(script.read_text(), str(script), "exec")
        exec(code, {"tagger": tagger, "params": params, "out": out})
        outs.append(out)
    files = sorted(os.listdir(outs[0]))
    assert files == sorted(os.listdir(outs[1]))
    for name in files:
        with (
            open(os.path.join(outs[0], name), "rb") as a,
            open(os.path.join(outs[1], name), "rb") as b,
        ):
            assert a.read() == b.read(), name
    cache = str(tmp_path / "cache")
    pxrt.load(outs[0], compilation_cache=cache).close()
    compiles = _xla.compile_counter.total
    warm = pxrt.load(outs[1], compilation_cache=cache)
    assert {b.source for b in warm.engine.buckets} == {"stored"}
    assert _xla.compile_counter.total == compiles
    warm.close()


# --------------------------------------------------------------------------- a decoder


def _attend(params, x, k, v, keep, bias):
    logits = jnp.einsum("...d,...ld->...l", x @ params["q"], k) + bias
    weights = jax.nn.softmax(jnp.where(keep, logits, -1e30), axis=-1)
    return x + jnp.einsum("...l,...ld->...d", weights, v)


def pt_prefill(params, tokens, lengths):
    n = tokens.shape[1]
    x = params["embed"][tokens] + params["pos"][:n]
    k, v = x @ params["k"], x @ params["v"]
    idx = jnp.arange(n)
    keep = (idx[None, :] <= idx[:, None])[None] & (idx < lengths[:, None])[:, None, :]
    h = jax.vmap(lambda xi, ki, vi, kp: _attend(params, xi, ki, vi, kp, params["bias"][:n]))(
        x, k, v, keep
    )
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return {"k": k, "v": v}, last @ params["head"]


def pt_decode(params, cache, tokens, positions):
    return _decode(params, cache, tokens, positions, jnp.arange(tokens.shape[0]))


def _decode(params, cache, tokens, positions, slots):
    length = cache["k"].shape[1]
    x = params["embed"][tokens] + params["pos"][positions]
    kc = cache["k"].at[slots, positions].set(x @ params["k"])
    vc = cache["v"].at[slots, positions].set(x @ params["v"])
    keep = jnp.arange(length)[None, :] <= positions[:, None]
    # A learned bias per cache position: the table sliced to the cache's length.
    h = _attend(
        params, x[:, None], kc[:, None], vc[:, None], keep[:, None], params["bias"][:length]
    )
    return {"k": kc, "v": vc}, h[:, 0] @ params["head"]


CACHE = {
    "k": pxrt.TensorSpec(("length", DIM), "float32"),
    "v": pxrt.TensorSpec(("length", DIM), "float32"),
}


def greedy(params, prompt, max_tokens, prefill=pt_prefill, decode=pt_decode):
    """Plain JAX: prefill at the prompt's own length, then one slot (a cache leaf without
    a sequence axis as prefill gave it)."""
    prefill, decode = jax.jit(prefill), jax.jit(decode)
    n = len(prompt)
    rows, logits = prefill(params, jnp.asarray([prompt], jnp.int32), jnp.asarray([n], jnp.int32))
    cache = {
        k: jnp.zeros((1, MAX_LENGTH, DIM)).at[:, :n].set(r) if r.ndim == 3 else r
        for k, r in rows.items()
    }
    tokens = [int(jnp.argmax(logits[0]))]
    while len(tokens) < max_tokens:
        at = jnp.asarray([n + len(tokens) - 1], jnp.int32)
        cache, logits = decode(params, cache, jnp.asarray([tokens[-1]], jnp.int32), at)
        tokens.append(int(jnp.argmax(logits[0])))
    return tokens


@pytest.fixture(scope="module")
def pt_path(tmp_path_factory):
    return pxrt.export_decoder(
        pt_prefill, pt_decode, make_params(7), str(tmp_path_factory.mktemp("pt") / "pt"),
        cache=CACHE, max_length=MAX_LENGTH, slots=4, prefill_lengths=LENGTHS,
        prefill_batches=(1,),
    )  # fmt: skip


def test_a_decoder_with_position_tables_generates_like_jax(pt_path, tmp_path):
    params = make_params(7)
    manifest = json.loads(open(os.path.join(pt_path, "manifest.json")).read())
    assert manifest["bounds"] == {"seq": max(LENGTHS), "length": MAX_LENGTH}
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, VOCAB, n).astype(np.int32) for n in (3, 9, 16, 5, 12, 1)]
    with pxrt.load(pt_path, step_slots=(), sampling_controls=False) as dec:
        streams = [dec.submit(p, max_tokens=10) for p in prompts]
        for prompt, stream in zip(prompts, streams):
            assert stream.result(timeout=60).tokens == greedy(params, prompt, 10)
    with pytest.raises(ValueError, match=r"'length' lengths \[64\] are over 32"):
        pxrt.load(pt_path, max_length=64)
    # Unbounded, the cache's length cannot be compared with the bias table's rows.
    with pytest.raises(
        ExportError, match=r"(?s)decode could not be traced.*slots \(batch\), length \(unbounded\)"
    ):
        pxrt.export_decoder(
            pt_prefill, pt_decode, params, tmp_path / "x", cache=CACHE, max_length=MAX_LENGTH,
            prefill_lengths=LENGTHS, bounds={"length": None},
        )  # fmt: skip


def mix_prefill(params, tokens, lengths):
    """A cache leaf with no sequence axis beside k and v: ``mix``, a running mean of
    the inputs, updated by every step (what a recurrent layer's state is)."""
    rows, logits = pt_prefill(params, tokens, lengths)
    x = params["embed"][tokens] * (jnp.arange(tokens.shape[1]) < lengths[:, None])[..., None]
    mix = x.sum(axis=1) / lengths[:, None]
    return rows | {"mix": mix}, logits + mix @ params["head"]


def mix_decode(params, cache, tokens, positions):
    kv, logits = pt_decode(params, {"k": cache["k"], "v": cache["v"]}, tokens, positions)
    mix = 0.5 * cache["mix"] + 0.5 * params["embed"][tokens]
    return kv | {"mix": mix}, logits + mix @ params["head"]


def test_a_cache_leaf_without_a_sequence_axis_steps_over_the_busy_slots(tmp_path):
    """The steps over fewer slots write a slot's k and v back at its position only,
    and a leaf without a sequence axis whole: tokens equal plain JAX while requests of
    different lengths end and the busy slots are moved down."""
    params = make_params(5)
    cache = CACHE | {"mix": pxrt.TensorSpec((DIM,), "float32")}
    path = pxrt.export_decoder(
        mix_prefill, mix_decode, params, str(tmp_path / "mix"), cache=cache,
        max_length=MAX_LENGTH, slots=8, prefill_lengths=(16,), prefill_batches=(1,),
    )  # fmt: skip
    rng = np.random.default_rng(4)
    work = [(rng.integers(0, VOCAB, n).astype(np.int32), m)
            for n, m in ((5, 3), (12, 14), (2, 6), (9, 2), (16, 10), (7, 12))]  # fmt: skip
    with pxrt.load(path, prefix_cache_tokens=0, sampling_controls=False) as dec:
        assert dec.wait_programs(120)  # (the steps over fewer slots come after the load)
        dec._step_prices = {}  # (by rule: the fewest rows, counted below; not by price)
        assert len(dec.step_slots) > 1
        streams = [dec.submit(p, max_tokens=m) for p, m in work]
        for (prompt, m), stream in zip(work, streams):
            assert stream.result(timeout=60).tokens == greedy(
                params, prompt, m, mix_prefill, mix_decode
            )
        counters = dec.counters
        assert counters["stepped_slots"] < counters["steps"] * dec.slots  # (fewer ran)


def len_prefill(params, tokens, lengths):
    """gemma's way to the last prompt token: ``x[jnp.arange(len(x)), lengths - 1]``."""
    n = tokens.shape[1]
    x = params["embed"][tokens] + params["pos"][:n]
    k, v = x @ params["k"], x @ params["v"]
    idx = jnp.arange(n)
    keep = (idx[None, :] <= idx[:, None])[None] & (idx < lengths[:, None])[:, None, :]
    h = jnp.stack(
        [_attend(params, x[i], k[i], v[i], keep[i], params["bias"][:n]) for i in range(len(x))]
    )
    last = h[jnp.arange(len(h)), lengths - 1]
    return {"k": k, "v": v}, last @ params["head"]


def len_decode(params, cache, tokens, positions):
    slots = jnp.arange(len(tokens))
    return _decode(params, cache, tokens, positions, slots)


def test_a_decoder_that_calls_len_exports_with_concrete_shapes(tmp_path):
    params = make_params(7)
    common = dict(cache=CACHE, max_length=MAX_LENGTH, slots=4, prefill_lengths=LENGTHS,
                  prefill_batches=(1, 2))  # fmt: skip
    with pytest.raises(ExportError, match="(?s)prefill could not be traced.*shapes='concrete'"):
        pxrt.export_decoder(len_prefill, len_decode, params, tmp_path / "sym", **common)
    n_dev = len(jax.devices())
    path = pxrt.export_decoder(
        len_prefill, len_decode, params, tmp_path / "conc", shapes="concrete",
        num_devices=n_dev, **common,
    )  # fmt: skip
    manifest = json.loads((tmp_path / "conc" / "manifest.json").read_text())
    assert manifest["shapes"] == "concrete" and manifest["decoder"]["num_devices"] == n_dev
    assert [p["cell"] for p in manifest["programs"]][-1] == [4 // n_dev, MAX_LENGTH]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, n).astype(np.int32) for n in (2, 16, 7, 11, 4)]
    with pxrt.load(path, sampling_controls=False) as dec:
        streams = [dec.submit(p, max_tokens=8) for p in prompts]
        for prompt, stream in zip(prompts, streams):
            assert stream.result(timeout=60).tokens == greedy(params, prompt, 8)
    with pytest.raises(ValueError, match=r"shapes='concrete' for 32 max_length, not 24"):
        pxrt.load(path, max_length=24)
    with pytest.raises(ValueError, match=r"prefill_lengths \[8, 16\]; \[12\] were not traced"):
        pxrt.load(path, prefill_lengths=(12,))


def one_index_step(params, cache, tokens, end_index):
    """A library's cached step: every row of the batch written at one index, as gemma's
    and keras-hub's attention caches do."""
    length = cache["k"].shape[1]
    x = params["embed"][tokens] + params["pos"][end_index]
    kc = cache["k"].at[:, end_index].set(x @ params["k"])
    vc = cache["v"].at[:, end_index].set(x @ params["v"])
    keep = jnp.broadcast_to(jnp.arange(length) <= end_index, (len(tokens), length))
    h = _attend(
        params, x[:, None], kc[:, None], vc[:, None], keep[:, None], params["bias"][:length]
    )
    return {"k": kc, "v": vc}, h[:, 0] @ params["head"]


def test_per_slot_turns_a_one_index_step_into_pxrts_decode(tmp_path):
    params = make_params(7)
    decode = pxrt.per_slot(lambda p, cache, tokens, at: one_index_step(p, cache, tokens, at[0]))
    path = pxrt.export_decoder(
        pt_prefill, decode, params, tmp_path / "lib", cache=CACHE, max_length=MAX_LENGTH,
        slots=4, prefill_lengths=LENGTHS, prefill_batches=(1,),
    )  # fmt: skip
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB, n).astype(np.int32) for n in (5, 16, 1, 9, 12)]
    with pxrt.load(path, step_slots=(), sampling_controls=False) as dec:
        streams = [dec.submit(p, max_tokens=9) for p in prompts]
        for prompt, stream in zip(prompts, streams):
            assert stream.result(timeout=60).tokens == greedy(params, prompt, 9)


def test_openai_completions_without_a_tokenizer_carry_token_ids(pt_path):
    from serving import Server
    from serving.http.app import create_app

    params = make_params(7)
    prompt = [5, 9, 2, 33]
    want = greedy(params, prompt, 6)

    async def main():
        dec = pxrt.load(pt_path, step_slots=(), sampling_controls=False)
        server = Server()
        server.add_decoder("pt", dec)
        transport = httpx.ASGITransport(app=create_app(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://pxrt") as client:
            body = {"model": "pt", "prompt": prompt, "max_tokens": 6, "temperature": 0}
            whole = (await client.post("/v1/completions", json=body)).json()
            streamed = await client.post("/v1/completions", json=body | {"stream": True})
        await server.close()
        dec.close()
        return whole, streamed.text

    whole, streamed = asyncio.run(main())
    choice = whole["choices"][0]
    assert choice["text"] is None and choice["token_ids"] == want, whole
    assert choice["prompt_token_ids"] == prompt
    assert whole["usage"]["completion_tokens"] == len(want)
    events = [json.loads(e[6:]) for e in streamed.split("\n\n") if e.startswith("data: {")]
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == want
    assert events[0]["choices"][0]["prompt_token_ids"] == prompt
    assert all(e["choices"][0]["text"] is None for e in events)
