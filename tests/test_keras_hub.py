"""keras-hub models through ``pxrt.adapters.keras_hub``, on tiny random-init configs (no
downloads): a BERT backbone's outputs against keras's own forward pass; Gemma and other
causal LMs' greedy tokens against keras-hub's own generation under continuous batching;
GPT-2 and Llama 3 with their byte-pair tokenizers carried; ResNet and ViT classifiers;
a recurrent model refused by name. Then BERT, GPT-2, Llama 3 and the image models behind
``pxrt serve``, answering the unmodified Triton and OpenAI clients."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is first imported

import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")

import pxrt  # noqa: E402
from pxrt.adapters import keras_hub as adapter  # noqa: E402

VOCAB = 64
MAX_LENGTH = 32


def unit_scale(lm, seed):
    """keras's initializers leave a tiny model's greedy tokens one token repeated; weights
    of unit scale make every token depend on the context, so a wrong cache shows."""
    rng = np.random.default_rng(seed)
    for v in lm.variables:
        fan_in = v.shape[0] if len(v.shape) > 1 else 1
        v.assign(rng.standard_normal(v.shape).astype(np.float32) / np.sqrt(fan_in))
    return lm


@pytest.fixture(scope="module")
def bert():
    keras.utils.set_random_seed(1)
    return keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=64, name="bert",
    )  # fmt: skip


@pytest.fixture(scope="module")
def gemma():
    keras.utils.set_random_seed(2)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8,
    )  # fmt: skip
    lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None, name="gemma")
    lm.compile(sampler="greedy")
    return unit_scale(lm, 2)


@pytest.fixture(scope="module")
def bert_path(bert, tmp_path_factory):
    path = tmp_path_factory.mktemp("bert") / "bert"
    return adapter.export_backbone(bert, path, seq_lengths=(8, 16), batch_buckets=(4,))


@pytest.fixture(scope="module")
def gemma_path(gemma, tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma") / "gemma"
    return adapter.export_causal_lm(
        gemma, path, max_length=MAX_LENGTH, slots=4, prefill_lengths=(8, 16),
        prefill_batches=(1, 2),
    )  # fmt: skip


# A byte-level BPE vocabulary small enough to write out: GPT-2's conventions (the
# <|endoftext|> token starts and ends a text; "Ġ" is a space before a word).
GPT2_TOKENS = ["<|endoftext|>", *"abcdefghijklmnopqrstuvwxyz", "Ġ", "!", ",",
               "th", "he", "the", "Ġt", "Ġthe", "at", "Ġc", "Ġcat", "Ġh", "Ġhat", "an"]  # fmt: skip
GPT2_MERGES = ["t h", "h e", "th e", "Ġ t", "Ġt he", "a t", "Ġ c", "Ġc at", "Ġ h", "Ġh at",
               "a n"]  # fmt: skip


LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                  "<|end_header_id|>"]  # fmt: skip
BPE_FAMILIES = {
    "gpt2": (
        "GPT2", GPT2_TOKENS,
        dict(num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
             max_sequence_length=MAX_LENGTH),
    ),
    "llama3": ("Llama3", LLAMA3_SPECIAL + GPT2_TOKENS[1:], dict(
        num_layers=1, num_query_heads=2, num_key_value_heads=1, hidden_dim=16,
        intermediate_dim=32,
    )),
}  # fmt: skip


def bpe_lm(family):
    """A keras-hub causal LM with its byte-pair tokenizer and preprocessor, scaled init."""
    prefix, tokens, config = BPE_FAMILIES[family]
    keras.utils.set_random_seed(5)
    models = keras_hub.models
    tokenizer = getattr(models, f"{prefix}Tokenizer")(
        vocabulary={t: i for i, t in enumerate(tokens)}, merges=GPT2_MERGES
    )
    preprocessor = getattr(models, f"{prefix}CausalLMPreprocessor")(
        tokenizer=tokenizer, sequence_length=MAX_LENGTH
    )
    backbone = getattr(models, f"{prefix}Backbone")(vocabulary_size=VOCAB, **config)
    lm = getattr(models, f"{prefix}CausalLM")(backbone=backbone, preprocessor=preprocessor)
    lm.compile(sampler="greedy")
    return unit_scale(lm, 6)


def _bpe_export(lm, family, tmp_path_factory):
    return adapter.export_causal_lm(
        lm, tmp_path_factory.mktemp(family) / family, max_length=MAX_LENGTH, slots=2,
        prefill_lengths=(8, 16), prefill_batches=(1,),
    )  # fmt: skip


@pytest.fixture(scope="module")
def gpt2():
    return bpe_lm("gpt2")


@pytest.fixture(scope="module")
def gpt2_path(gpt2, tmp_path_factory):
    return _bpe_export(gpt2, "gpt2", tmp_path_factory)


@pytest.fixture(scope="module")
def llama3():
    return bpe_lm("llama3")


@pytest.fixture(scope="module")
def llama3_path(llama3, tmp_path_factory):
    return _bpe_export(llama3, "llama3", tmp_path_factory)


def keras_ids(lm, text):
    """The ids keras-hub's ``generate(text)`` runs on: its preprocessing, unpadded."""
    x = lm.preprocessor.generate_preprocess([text])
    return [int(t) for t, m in zip(np.asarray(x["token_ids"])[0], np.asarray(x["padding_mask"])[0])
            if m]  # fmt: skip


@pytest.mark.parametrize("family", BPE_FAMILIES)
def test_a_byte_pair_tokenizer_is_carried_with_its_start_token(family, request):
    """GPT-2's and Llama 3's byte-pair tokenizers go into the artifact as the
    tokenizer.json keras-hub tokenizes with, and the preprocessor's start token
    (<|endoftext|>, <|begin_of_text|>) as the artifact's start_ids: a text prompt gets
    the ids keras-hub's generate(text) runs on, and the same greedy tokens; keras-hub's
    end tokens (Llama 3's two) stop it."""
    lm, path = request.getfixturevalue(family), request.getfixturevalue(f"{family}_path")
    tok = lm.preprocessor.tokenizer
    art = pxrt.decoder.read(path)
    assert art.config["tokenizer"] == {"kind": "tokenizers", "start_ids": [tok.start_token_id]}
    ends = {tok.end_token_id, getattr(tok, "end_token2_id", tok.end_token_id)}
    assert ends <= set(art.config["stop_ids"])
    with pxrt.load(path, step_slots=(), sampling_controls=False) as dec:
        for text in ("the cat", "a hat, the hat!", "zebra"):
            ids = keras_ids(lm, text)
            assert ids[0] == tok.start_token_id and dec.tokenizer.encode(text) == ids, text
            out = dec.generate(text, max_tokens=6)
            want = keras_greedy(lm, ids, 6)
            assert out.tokens == want[: len(out.tokens)] and out.prompt_tokens == len(ids)
            assert len(out.tokens) == 6 or out.tokens[-1] in ends
        assert dec.tokenizer.encode(dec.tokenizer.decode(ids[1:])) == ids  # round trip


@pytest.fixture(scope="module")
def image_models(tmp_path_factory):
    """A ResNet and a ViT image classifier (keras-hub's tasks over tiny backbones),
    exported with export_image_model: {name: (model, artifact path)}."""
    keras.utils.set_random_seed(7)
    models = keras_hub.models
    resnet = models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[7], stackwise_num_filters=[64, 64],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
        image_shape=(32, 32, 3),
    )  # fmt: skip
    vit = models.ViTBackbone(
        image_shape=(32, 32, 3), patch_size=8, num_layers=1, num_heads=2, hidden_dim=16,
        mlp_dim=32,
    )  # fmt: skip
    out = {}
    for name, model in [
        ("resnet", models.ResNetImageClassifier(backbone=resnet, num_classes=5, preprocessor=None)),
        ("vit", models.ViTImageClassifier(backbone=vit, num_classes=5, preprocessor=None)),
    ]:
        path = tmp_path_factory.mktemp(name) / name
        out[name] = (model, adapter.export_image_model(model, path, batch_buckets=(1, 4)))
    return out


def test_image_models_export_with_a_batch_of_images(image_models, tmp_path):
    """export_image_model takes keras-hub image tasks and backbones (one tensor of
    images); export_backbone, which wants named inputs, says to use it."""
    images = np.random.default_rng(8).standard_normal((3, 32, 32, 3)).astype(np.float32)
    for name, (model, path) in image_models.items():
        art = pxrt.read_artifact(path)
        assert list(art.inputs) == ["images"] and art.inputs["images"].shape == (32, 32, 3)
        with pxrt.load(path) as served:
            got = served.run({"images": images})["output"]
        want = np.asarray(model(images, training=False))
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert got.shape == (3, 5) and np.ptp(want) > 0.1, name  # (logits that differ)
    backbone = image_models["vit"][0].backbone
    with pytest.raises(ValueError, match="an image model .* exports with export_image_model"):
        adapter.export_backbone(backbone, tmp_path / "b")


def bert_request(rows, n, seed):
    rng = np.random.default_rng(seed)
    mask = np.ones((rows, n), bool)
    mask[0, n // 2 :] = False  # a padded row, as a tokenizer gives it
    return {  # (BertBackbone's padding_mask input is int32)
        "token_ids": rng.integers(0, VOCAB, (rows, n)).astype(np.int32),
        "segment_ids": (np.arange(n) >= n // 3).astype(np.int32)[None].repeat(rows, 0),
        "padding_mask": mask.astype(np.int32),
    }


def test_a_bert_backbone_serves_like_keras(bert, bert_path):
    art = pxrt.read_artifact(bert_path)
    assert set(art.inputs) == {"token_ids", "segment_ids", "padding_mask"}
    assert art.bounds == {"seq": 16}  # its position table has 64 rows
    with pxrt.load(bert_path) as model:
        for rows, n in ((1, 5), (3, 11), (4, 16)):
            request = bert_request(rows, n, seed=n)
            got = model.run(request)
            want = bert(request, training=False)
            assert set(got) == {"sequence_output", "pooled_output"}
            for k in got:
                np.testing.assert_allclose(got[k], np.asarray(want[k]), atol=1e-5, err_msg=k)


def keras_greedy(lm, prompt, max_tokens):
    """keras-hub's own generation (``generate_step``, jitted as ``generate`` runs it, with
    its greedy sampler and no stop token) for one prompt."""
    tokens = np.zeros((1, MAX_LENGTH), np.int32)
    tokens[0, : len(prompt)] = prompt
    mask = np.zeros((1, MAX_LENGTH), bool)
    mask[0, : len(prompt)] = True
    # ``make_generate_function``: generate_step under jax.jit, compiled once per model and
    # shape (called as is, every call traced and compiled its while loop again).
    generate = lm.make_generate_function()
    out = generate({"token_ids": tokens, "padding_mask": mask}, stop_token_ids=None)
    return [int(t) for t in np.asarray(out["token_ids"])[0, len(prompt) : len(prompt) + max_tokens]]


def test_a_gemma_causal_lm_generates_like_keras_hub(gemma, gemma_path):
    rng = np.random.default_rng(3)
    # Longer than the longest prefill (16): chunked by extend; the last one's first 16
    # tokens are the first long one's, reused from the prefix cache.
    prompts = [rng.integers(1, VOCAB, n).astype(np.int32) for n in (3, 16, 7, 1, 12, 9, 21)]
    prompts.append(np.concatenate([prompts[-1][:18], [5, 6]]).astype(np.int32))
    with pxrt.load(
        gemma_path, step_slots=(), sampling_controls=False
    ) as dec:  # (fewer slots: test_generate.py)
        assert dec.wait_programs(120)
        streams = [dec.submit(p, max_tokens=10) for p in prompts[:-1]]  # 7 prompts, 4 slots
        streams[-1].result(timeout=120)
        streams.append(dec.submit(prompts[-1], max_tokens=10))
        seen = set()
        for prompt, stream in zip(prompts, streams):
            want = keras_greedy(gemma, prompt, 10)
            assert stream.result(timeout=120).tokens == want
            seen |= set(want)
        assert len(seen) > 10, seen  # (tokens that follow the context, not one repeated)
        assert set(dec.load_phases) == {"read", "programs", "warm-up", "measure"}
        assert dec.counters["chunks"] >= 1 and dec.counters["prefix_hit_tokens"] == 16


def test_pxrt_serve_answers_triton_and_openai_clients_with_no_keras(
    bert, gpt2, llama3, bert_path, gpt2_path, llama3_path, image_models, tmp_path, monkeypatch
):
    """Both artifacts behind `pxrt serve` in a process where keras cannot be imported:
    the unmodified tritonclient and openai clients get what keras computes."""
    import tritonclient.http as httpclient
    from openai import OpenAI
    from servers import ServeProcess

    for name in ("keras", "keras_hub"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    images = [path for _, path in image_models.values()]
    proc = ServeProcess([bert_path, gpt2_path, llama3_path, *images])
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{proc.port}")
        request = bert_request(2, 9, seed=4)
        inputs = []
        for name, value in request.items():
            inputs.append(httpclient.InferInput(name, list(value.shape), "INT32"))
            inputs[-1].set_data_from_numpy(value)
        got = client.infer("bert", inputs).as_numpy("pooled_output")
        want = np.asarray(bert(request, training=False)["pooled_output"])
        np.testing.assert_allclose(got, want, atol=1e-5)
        pictures = np.random.default_rng(9).standard_normal((2, 32, 32, 3)).astype(np.float32)
        for name, (model, _) in image_models.items():  # a batch of images, one tensor
            x = httpclient.InferInput("images", [2, 32, 32, 3], "FP32")
            x.set_data_from_numpy(pictures)
            got = client.infer(name, [x]).as_numpy("output")
            want = np.asarray(model(pictures, training=False))
            np.testing.assert_allclose(got, want, atol=1e-5)
        openai = OpenAI(base_url=f"{proc.url}/v1", api_key="unused")
        # text in and out, with the tokenizer carried: keras-hub's ids, its tokens' text
        text = "the cat"
        for name, lm in [("gpt2", gpt2), ("llama3", llama3)]:
            out = openai.completions.create(model=name, prompt=text, max_tokens=5, temperature=0)
            tok = lm.preprocessor.tokenizer
            ends = {tok.end_token_id, getattr(tok, "end_token2_id", tok.end_token_id)}
            want = keras_greedy(lm, keras_ids(lm, text), 5)
            cut = next((i + 1 for i, t in enumerate(want) if t in ends), len(want))
            want = want[:cut]  # (an end token ends a text)
            assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == len(want)
            words = tok.detokenize([t for t in want if t not in ends])
            assert out.choices[0].text == words and len(want) > 1, (name, want)
    finally:
        proc.stop()


TINY = dict(vocabulary_size=VOCAB, num_layers=1, num_query_heads=2, num_key_value_heads=1,
            hidden_dim=16, intermediate_dim=32)  # fmt: skip
FAMILIES = {
    "llama": ("LlamaBackbone", "LlamaCausalLM", {}),
    "mistral": ("MistralBackbone", "MistralCausalLM", {}),
    "qwen": ("QwenBackbone", "QwenCausalLM", {}),
    "qwen3": ("Qwen3Backbone", "Qwen3CausalLM", {"head_dim": 8}),
    "gemma3": ("Gemma3Backbone", "Gemma3CausalLM", {"head_dim": 8, "image_size": 16}),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_other_causal_lm_families_generate_like_keras_hub(family, tmp_path):
    backbone_cls, lm_cls, extra = FAMILIES[family]
    keras.utils.set_random_seed(3)
    backbone = getattr(keras_hub.models, backbone_cls)(**TINY, **extra)
    lm = getattr(keras_hub.models, lm_cls)(backbone=backbone, preprocessor=None)
    lm.compile(sampler="greedy")
    unit_scale(lm, 4)
    rng = np.random.default_rng(4)
    path = adapter.export_causal_lm(
        lm, tmp_path / family, max_length=MAX_LENGTH, slots=2, prefill_lengths=(8,),
        prefill_batches=(1,),
    )  # fmt: skip
    # served as its directory's name, not keras's layer name (gpt2_causal_lm...)
    assert pxrt.decoder.read(path).name == family != lm.name
    # 13 tokens: chunked (prefill goes to 8); then again, its first 12 from the prefix
    # cache (blocks of 4) and the last one computed by extend.
    prompts = [rng.integers(1, VOCAB, n).astype(np.int32) for n in (2, 8, 5, 13)]
    with pxrt.load(path, prefix_block=4, step_slots=(), sampling_controls=False) as dec:
        assert dec.wait_programs(120)
        streams = [dec.submit(p, max_tokens=8) for p in prompts]
        for prompt, stream in zip(prompts, streams):
            assert stream.result(timeout=120).tokens == keras_greedy(lm, prompt, 8)
        assert dec.generate(prompts[-1], max_tokens=8).tokens == keras_greedy(lm, prompts[-1], 8)
        assert dec.counters["prefix_hit_tokens"] == 12


def test_a_prefill_projects_the_last_position_only_where_that_is_the_models_head(tmp_path):
    """A prompt's first token needs the logits of its last position: the prefill runs
    keras-hub's token embedding in reverse on that position's hidden state, where it
    was checked to be what ``call_with_cache`` does (every family above takes that way).
    A model whose logits are something more (here a bias added after the embedding)
    keeps every position's logits, and its first tokens are still keras-hub's."""
    bias = np.random.default_rng(5).normal(0.0, 3.0, VOCAB).astype(np.float32)

    class Biased(keras_hub.models.LlamaCausalLM):
        def call_with_cache(self, token_ids, cache, cache_update_index):
            logits, hidden, cache = super().call_with_cache(token_ids, cache, cache_update_index)
            return logits + keras.ops.convert_to_tensor(bias), hidden, cache

    keras.utils.set_random_seed(3)
    made = {}
    for cls in (keras_hub.models.LlamaCausalLM, Biased):
        lm = cls(backbone=keras_hub.models.LlamaBackbone(**TINY), preprocessor=None)
        lm.compile(sampler="greedy")
        made[cls] = unit_scale(lm, 6)
    assert adapter.last_logits_head(made[keras_hub.models.LlamaCausalLM], adapter.cache_spec(lm))
    lm = made[Biased]
    assert adapter.last_logits_head(lm, adapter.cache_spec(lm)) is None
    path = adapter.export_causal_lm(
        lm, tmp_path / "biased", max_length=MAX_LENGTH, slots=2, prefill_lengths=(8,),
        prefill_batches=(1,),
    )  # fmt: skip
    prompts = [np.random.default_rng(6).integers(1, VOCAB, n).astype(np.int32) for n in (3, 8)]
    with pxrt.load(path, step_slots=(), sampling_controls=False, prefix_cache_tokens=0) as dec:
        for prompt in prompts:
            assert dec.generate(prompt, max_tokens=4).tokens == keras_greedy(lm, prompt, 4)


def test_a_recurrent_model_is_refused_by_name(tmp_path):
    """RWKV7's cache is a recurrent state: no axis follows the length. The adapter says
    so, and why (a padded prefill would change the state), instead of a shape puzzle."""
    backbone = keras_hub.models.RWKV7Backbone(
        hidden_size=16, head_size=8, num_layers=1, vocabulary_size=VOCAB, intermediate_dim=32,
        gate_lora=4, mv_lora=4, aaa_lora=4, decay_lora=4,
    )  # fmt: skip
    lm = keras_hub.models.RWKV7CausalLM(backbone=backbone, preprocessor=None)
    with pytest.raises(ValueError, match="RWKV7CausalLM's cache does not grow with the sequence"):
        adapter.export_causal_lm(lm, tmp_path / "rwkv", max_length=MAX_LENGTH, slots=2)
