"""Hugging Face Flax causal LMs through ``pxrt.adapters.transformers``, on tiny random
configs (no downloads) with weights of unit scale, so that the greedy tokens follow the
context: under continuous batching, chunked prefill and the prefix cache, each
generation equals HF's own ``generate`` (greedy) for that prompt alone."""

from __future__ import annotations

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
jax = pytest.importorskip("jax")

import pxrt  # noqa: E402
from pxrt.adapters import transformers as adapter  # noqa: E402

VOCAB = 64
MAX_LENGTH = 32
EOS = VOCAB - 1


def _scaled(model, seed: int):
    """Weights of unit scale: matrices over their fan-in, embeddings as drawn."""
    rng = np.random.default_rng(seed)

    def draw(p):
        if p.ndim != 2:
            return p
        scale = np.sqrt(p.shape[0]) if p.shape[0] < VOCAB else 1.0
        return (rng.standard_normal(p.shape) / scale).astype(np.float32)

    model.params = jax.tree.map(draw, model.params)
    return model


MODELS = {
    "gpt2": lambda: transformers.FlaxGPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=MAX_LENGTH, n_embd=16, n_layer=2, n_head=2,
            eos_token_id=EOS, bos_token_id=EOS,
        ),
        seed=0,
    ),
    "llama": lambda: transformers.FlaxLlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=MAX_LENGTH,
            eos_token_id=EOS, bos_token_id=EOS - 1,
        ),
        seed=0,
    ),
}  # fmt: skip


def hf_generate(model, prompt, max_tokens):
    """HF's own ``generate``, greedy (it compiles its loop for each prompt length)."""
    out = model.generate(
        np.asarray(prompt, np.int32)[None], max_new_tokens=max_tokens, do_sample=False,
        pad_token_id=EOS,
    )  # fmt: skip
    return _until_eos(np.asarray(out.sequences)[0, len(prompt) :].tolist())


def _until_eos(tokens):
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def hf_greedy(model):
    """Greedy decoding with HF's forward pass over the whole sequence each step, at one
    padded shape (compiled once): ``(prompt, max_tokens) -> tokens``."""
    forward = jax.jit(lambda ids, mask: model(ids, attention_mask=mask, position_ids=None).logits)

    def greedy(prompt, max_tokens):
        seq = list(prompt)
        for _ in range(max_tokens):
            ids = np.zeros((1, MAX_LENGTH), np.int32)
            ids[0, : len(seq)] = seq
            mask = (np.arange(MAX_LENGTH) < len(seq)).astype(np.int32)[None]
            seq.append(int(np.argmax(np.asarray(forward(ids, mask))[0, len(seq) - 1])))
        return _until_eos(seq[len(prompt) :])

    return greedy


@pytest.mark.parametrize("family", MODELS)
def test_a_flax_causal_lm_generates_like_hf(family, tmp_path):
    model = _scaled(MODELS[family](), seed=1)
    # (the prefill projects the prompt's last position only: GPT-2's tied embedding,
    # Llama's lm_head, each checked against the model's logits)
    assert adapter.last_logits_head(model) is not None
    path = adapter.export_causal_lm(
        model, tmp_path / family, max_length=MAX_LENGTH, slots=2, prefill_lengths=(16,),
        prefill_batches=(1,),
    )  # fmt: skip
    assert pxrt.decoder.read(path).name == family
    rng = np.random.default_rng(2)
    # 20 tokens: chunked (prefill goes to 16); the last repeats its first 16 (cached)
    prompts = [rng.integers(0, EOS, n).tolist() for n in (3, 11, 20)]
    prompts.append([*prompts[-1][:16], 5, 6])
    reference = hf_greedy(model)
    assert reference(prompts[2], 6) == hf_generate(model, prompts[2], 6)  # (HF's own)
    seen = set()
    with pxrt.load(path, prefix_block=4, step_slots=(), sampling_controls=False) as dec:
        assert dec.wait_programs(120)  # (the prefix cache's programs come after the load)
        streams = [dec.submit(p, max_tokens=6) for p in prompts[:-1]]  # 3 prompts, 2 slots
        streams[-1].result(timeout=120)  # (its blocks cached before the last one comes)
        streams.append(dec.submit(prompts[-1], max_tokens=6))
        for prompt, stream in zip(prompts, streams):
            want = reference(prompt, 6)
            assert stream.result(timeout=120).tokens == want, (family, len(prompt))
            seen |= set(want)
        assert dec.counters["chunks"] >= 1 and dec.counters["prefix_hit_tokens"] == 16
    assert len(seen) > 8, seen  # (tokens that follow the context, not one repeated)


def test_a_fast_tokenizer_is_carried_with_its_bos(tmp_path):
    """An HF fast tokenizer goes in as its tokenizer.json, and its BOS as the start ids
    where it adds one (Llama's): text prompts get HF's own ids."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    letters = "abcdefghijklmnopqrstuvwxyz "
    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(letters)}}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>"
    )
    file, start = adapter._tokenizer_file(hf, str(tmp_path))
    carried = pxrt.tokenizer.TokenizersTokenizer(file)
    assert carried.encode("hi there") == hf("hi there", add_special_tokens=False).input_ids
    assert start == []  # (it adds no BOS)
    hf.add_bos_token = True  # (as Llama's does)
    assert adapter._tokenizer_file(hf, str(tmp_path))[1] == [0]
    with pytest.raises(ValueError, match="is not a fast .* tokenizer"):
        adapter._tokenizer_file(object(), str(tmp_path))
