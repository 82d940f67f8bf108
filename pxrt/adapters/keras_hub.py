"""keras-hub models as pxrt artifacts, on keras's JAX backend (``KERAS_BACKEND=jax``).

- ``export_backbone(backbone, path, ...)``: a backbone (``BertBackbone``,
  ``GemmaBackbone``...) as a one-shot model. Its inputs are the functional model's
  (``token_ids``, ``padding_mask``, ``segment_ids``...) with the sequence as the named
  dimension ``seq``; its outputs are the backbone's (a dict by name, or ``output``).
- ``export_image_model(model, path, ...)``: an image backbone (``ResNetBackbone``,
  ``ViTBackbone``...) or task (an ``ImageClassifier``) as a one-shot model over a batch
  of images.
- ``export_causal_lm(causal_lm, path, ...)``: a causal LM (``GemmaCausalLM``,
  ``LlamaCausalLM``, ``MistralCausalLM``, ``QwenCausalLM``, ``Qwen3CausalLM``,
  ``Gemma3CausalLM`` (text)... anything with keras-hub's ``call_with_cache(token_ids,
  cache, cache_update_index)``) as a pxrt decoder. Prefill
  runs ``call_with_cache`` over the padded prompts from index 0, decode runs it for
  one token per slot at the slot's own index (``pxrt.per_slot``: keras-hub writes every
  row of a batch at one index), and extend for a chunk of tokens per slot the same way
  (long prompts are chunked, cached prompt starts reused). The cache is keras-hub's
  own, per slot.

Both read the weights through ``keras.StatelessScope``: the params are the model's
variables by path, the model object stays in the closure, and nothing of keras is
needed where the artifact is served. The causal LM's tokenizer goes into the artifact
(``carried_tokenizer``), unless ``tokenizer=`` names another: a SentencePiece ``proto``
as ``tokenizer.model`` (Gemma's, Llama 2's), a byte-pair or WordPiece tokenizer (GPT-2's,
OPT's, Llama 3's, Qwen's...) as the ``tokenizer.json`` of the ``tokenizers`` object
keras-hub itself tokenizes with; and the preprocessor's start token (``add_start_token``)
as the artifact's ``start_ids``, so that a served text prompt gets the ids
``generate(text)`` would.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..artifact import export
from ..decoder import export_decoder, is_spec
from ..recipes import per_slot
from ..specs import TensorSpec
from ._cache import per_slot_spec, same_logits
from ._inplace import in_place

SEQ = "seq"

log = logging.getLogger("pxrt")


def _keras() -> Any:
    import keras

    if keras.config.backend() != "jax":
        raise RuntimeError(
            f"keras runs on its {keras.config.backend()!r} backend: pxrt exports JAX "
            "programs. Set KERAS_BACKEND=jax before keras is first imported."
        )
    return keras


def params_of(model: Any) -> dict[str, np.ndarray]:
    """The model's variables (trainable or not) by path, as numpy arrays: what the
    artifact stores and the programs read the weights from."""
    keras = _keras()
    out: dict[str, np.ndarray] = {}
    for v in model.variables:
        if v.path in out:
            raise ValueError(f"{type(model).__name__}: two variables at path {v.path!r}")
        out[v.path] = np.asarray(keras.ops.convert_to_numpy(v.value))
    return out


@contextlib.contextmanager
def _weights(model: Any, params: Mapping[str, Any]) -> Iterator[None]:
    """The model's variables read as ``params`` (traced values) while tracing."""
    keras = _keras()
    mapping = [(v, params[v.path]) for v in model.variables]
    with keras.StatelessScope(state_mapping=mapping):
        yield


# --------------------------------------------------------------------------- backbones


def backbone_inputs(backbone: Any) -> dict[str, TensorSpec]:
    """The functional backbone's inputs as specs: the sequence axis named ``seq``."""
    specs = backbone.input if isinstance(backbone.input, dict) else None
    if specs is None:
        raise ValueError(
            f"{type(backbone).__name__} takes {type(backbone.input).__name__} inputs: "
            "export_backbone wants a keras-hub backbone with named inputs (a dict); an "
            "image model (one tensor of images) exports with export_image_model"
        )
    out = {}
    for name, kt in specs.items():
        shape = tuple(kt.shape[1:])
        if not shape or shape[0] is not None or any(d is None for d in shape[1:]):
            raise ValueError(
                f"input {name!r} has shape {kt.shape}: export_backbone takes sequence "
                "inputs (batch, sequence, fixed sizes...)"
            )
        dtype = "bool" if kt.dtype == "bool" else str(np.dtype(kt.dtype))
        out[name] = TensorSpec((SEQ, *shape[1:]), dtype)
    return out


def export_backbone(
    backbone: Any,
    path: str | os.PathLike,
    *,
    seq_lengths: Sequence[int] = (32, 64, 128),
    batch_buckets: Sequence[int] = (1, 8, 32),
    **options: Any,
) -> str:
    """Export a keras-hub backbone as a one-shot model: its inputs over a named sequence
    dimension compiled at ``seq_lengths``; ``options`` as for ``pxrt.export`` (``name``,
    ``bounds``, ``shapes``...). It is served as ``name``, by default the artifact
    directory's name (not keras's layer name). Returns the artifact path."""
    inputs = backbone_inputs(backbone)

    def fn(params: Any, **xs: Any) -> Any:
        with _weights(backbone, params):
            out = backbone(dict(xs), training=False)
        return dict(out) if isinstance(out, Mapping) else out

    return export(
        fn, params_of(backbone), path, inputs=inputs, batch_buckets=batch_buckets,
        dim_buckets={SEQ: tuple(seq_lengths)}, **options,
    )  # fmt: skip


# --------------------------------------------------------------------------- images


def image_input(model: Any, image_size: Sequence[int] | None = None) -> TensorSpec:
    """An image model's one input, a batch of images, as a spec: ``(height, width,
    channels)`` from the model (``image_size`` where the model leaves them open)."""
    kt = model.input
    if isinstance(kt, (dict, list, tuple)):
        raise ValueError(
            f"{type(model).__name__} takes {type(kt).__name__} inputs: export_image_model "
            "wants one tensor of images (batch, height, width, channels)"
        )
    shape = list(kt.shape[1:])
    if len(shape) != 3:
        raise ValueError(
            f"{type(model).__name__}'s input has shape {tuple(kt.shape)}: export_image_model "
            "wants (batch, height, width, channels)"
        )
    if image_size is not None:
        size = [int(x) for x in image_size]
        if len(size) != 2 or any(x < 1 for x in size):
            raise ValueError(f"image_size must be (height, width), got {image_size!r}")
        for i, (have, want) in enumerate(zip(shape[:2], size)):
            if have is not None and have != want:
                raise ValueError(
                    f"image_size {tuple(size)}: {type(model).__name__} is built for "
                    f"{tuple(shape[:2])}"
                )
            shape[i] = want
    if any(d is None for d in shape):
        raise ValueError(
            f"{type(model).__name__} takes images of any size {tuple(kt.shape)}: give "
            "image_size=(height, width), the size it is served at"
        )
    return TensorSpec(tuple(int(d) for d in shape), str(kt.dtype))


def export_image_model(
    model: Any,
    path: str | os.PathLike,
    *,
    batch_buckets: Sequence[int] = (1, 8, 32),
    image_size: Sequence[int] | None = None,
    input_name: str = "images",
    **options: Any,
) -> str:
    """Export a keras-hub image model (a backbone such as ``ResNetBackbone`` or
    ``ViTBackbone``, or a task such as ``ImageClassifier``) as a one-shot model: one
    input, ``input_name``, a batch of images ``(height, width, channels)`` as the model
    takes them (its preprocessor is not run: resize and rescale before, as keras-hub's
    preprocessor would), and the model's outputs (a dict by name, or ``output``: a
    classifier's logits). ``options`` as for ``pxrt.export``. Returns the artifact
    path."""
    spec = image_input(model, image_size)

    def fn(params: Any, **xs: Any) -> Any:
        with _weights(model, params):
            out = model(xs[input_name], training=False)
        return dict(out) if isinstance(out, Mapping) else out

    return export(
        fn, params_of(model), path, inputs={input_name: spec}, batch_buckets=batch_buckets,
        **options,
    )  # fmt: skip


# --------------------------------------------------------------------------- causal LMs


def cache_spec(causal_lm: Any) -> Any:
    """keras-hub's cache for one sequence (what ``_build_cache`` makes, without the
    batch: one array for most models, a pytree for some, such as Gemma3's (key, value)
    per layer) as ``TensorSpec``s, each sequence axis named ``length``: found by tracing
    it at two lengths."""
    import jax

    params = {v.path: jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in causal_lm.variables}
    # Arguments beyond the tokens (Gemma3's images) are not given: text only.
    others = {
        p.name: None
        for p in inspect.signature(causal_lm._build_cache).parameters.values()
        if p.name != "token_ids" and p.default is p.empty
    }

    def built(params: Any, tokens: Any) -> Any:
        with _weights(causal_lm, params):
            return causal_lm._build_cache(tokens, **others)[1]

    a, b = (jax.eval_shape(built, params, jax.ShapeDtypeStruct((1, n), "int32")) for n in (3, 5))
    if all(x.shape == y.shape for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))):
        raise ValueError(
            f"{type(causal_lm).__name__}'s cache does not grow with the sequence (arrays of "
            f"{[tuple(x.shape) for x in jax.tree.leaves(a)]} for 3 tokens and 5): a recurrent "
            "state. export_causal_lm does not export recurrent models: its prefill runs "
            "over prompts padded to a bucket, and the padding would change the state. "
            "pxrt.export_decoder takes a state leaf without a 'length' axis, with a "
            "prefill that leaves padding out of the state"
        )

    owner = type(causal_lm).__name__
    return jax.tree.map(lambda x, y: per_slot_spec(owner, "", x, y, (3, 5)), a, b)


def _empty_cache(spec: Any, batch: int, length: int) -> Any:
    """Zeros of keras-hub's cache (``spec``, per sequence) for ``batch`` sequences of
    ``length`` positions."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(
        lambda s: jnp.zeros((batch, *s.at({"length": length})), s.dtype), spec, is_leaf=is_spec
    )


def last_logits_head(causal_lm: Any, spec: Any) -> Any:
    """The function from ``call_with_cache``'s hidden states to its logits, so that a
    prefill computes the logits of each prompt's last position only (a prompt of n
    tokens otherwise pays n rows of the vocabulary's projection, of which the first
    token needs one: half of a small model's prefill, a fifth of a 2B model's with a
    256k vocabulary); None where it is not that.

    keras-hub's causal LMs end ``call_with_cache`` with ``logits =
    backbone.token_embedding(hidden_states, reverse=True)`` (Gemma's soft cap inside
    the embedding, Gemma 4's ``final_logit_cap`` after it). Whether this model does is
    checked, not assumed: a 3-token prompt run eagerly both ways (the real weights,
    no compile), the last position's logits equal to float32 rounding; a model whose
    head is something else (a multimodal wrapper's, a renamed embedding) keeps every
    position's logits."""
    import jax.numpy as jnp

    embedding = getattr(getattr(causal_lm, "backbone", None), "token_embedding", None)
    if embedding is None:
        return None
    cap = getattr(causal_lm, "final_logit_cap", None)

    def head(hidden: Any) -> Any:
        logits = embedding(hidden, reverse=True)
        if cap:
            logits = jnp.tanh(logits / cap) * cap
        return logits

    params = {v.path: v.value for v in causal_lm.variables}
    tokens = jnp.asarray([[1, 2, 3]], jnp.int32)
    try:
        with _weights(causal_lm, params):
            logits, hidden, _ = causal_lm.call_with_cache(tokens, _empty_cache(spec, 1, 3), 0)
            got = head(hidden[:, -1:])[:, 0]
    except Exception as exc:  # noqa: BLE001 - any failure: the logits as they are
        log.info("pxrt: %s: every position's logits (%s)", type(causal_lm).__name__, exc)
        return None
    if not same_logits(got, logits[:, -1]):
        log.info(
            "pxrt: %s's logits are not its token embedding's reverse of its hidden "
            "states: its prefill computes every position's logits",
            type(causal_lm).__name__,
        )
        return None
    return head


def carried_tokenizer(tokenizer: Any, directory: str) -> str | None:
    """A keras-hub tokenizer as a file pxrt carries, written into ``directory``: a
    SentencePiece ``proto`` as ``tokenizer.model``; the ``tokenizers.Tokenizer`` that
    keras-hub's byte-pair and WordPiece tokenizers run on as ``tokenizer.json`` (the same
    ids as keras-hub's). None, with a warning naming it, for one that cannot be."""
    proto = getattr(tokenizer, "proto", None)
    if isinstance(proto, bytes):
        path = os.path.join(directory, "tokenizer.model")
        with open(path, "wb") as f:
            f.write(proto)
        return path
    inner = getattr(tokenizer, "_tokenizer", None)
    if inner is not None and type(inner).__module__.startswith("tokenizers"):
        path = os.path.join(directory, "tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(inner.to_str())
        return path
    log.warning(
        "pxrt: %s cannot be carried into the artifact (neither a SentencePiece proto nor "
        "a tokenizers object): it serves token ids only; pass tokenizer= a tokenizer.json "
        "for text",
        type(tokenizer).__name__,
    )
    return None


def start_ids_of(preprocessor: Any) -> list[int]:
    """The ids keras-hub's ``generate_preprocess`` puts before a prompt: the start
    token, where the preprocessor adds it (``add_start_token``)."""
    start = getattr(getattr(preprocessor, "tokenizer", None), "start_token_id", None)
    if getattr(preprocessor, "add_start_token", False) and start is not None:
        return [int(start)]
    return []


def export_causal_lm(
    causal_lm: Any,
    path: str | os.PathLike,
    *,
    max_length: int = 512,
    slots: int = 8,
    prefill_lengths: Sequence[int] = (32, 128),
    prefill_batches: Sequence[int] = (1, 4),
    eos_id: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    **options: Any,
) -> str:
    """Export a keras-hub causal LM as a pxrt decoder (see the module docstring);
    ``options`` as for ``pxrt.export_decoder``. ``eos_id`` defaults to the tokenizer's
    end token. It is served as ``name``, by default the artifact directory's name (not
    keras's layer name, ``gpt_neo_x_causal_lm``). Returns the artifact path."""
    spec = cache_spec(causal_lm)

    head = last_logits_head(causal_lm, spec)

    def prefill(params: Any, tokens: Any, lengths: Any) -> Any:
        import jax.numpy as jnp

        at = (lengths - 1)[:, None, None]
        with _weights(causal_lm, params):
            cache = _empty_cache(spec, *tokens.shape)
            logits, hidden, cache = causal_lm.call_with_cache(tokens, cache, 0)
            if head is None:
                last = jnp.take_along_axis(logits, at, axis=1)[:, 0]
            else:  # (the logits of every position unused: XLA leaves them out)
                last = head(jnp.take_along_axis(hidden, at, axis=1))[:, 0]
        return {"kv": cache}, last.astype(jnp.float32)

    def one_sequence(params: Any, cache: Any, tokens: Any, positions: Any) -> Any:
        import jax.numpy as jnp

        with _weights(causal_lm, params):
            logits, _, kv = causal_lm.call_with_cache(tokens[:, None], cache["kv"], positions[0])
        return {"kv": kv}, logits[:, 0].astype(jnp.float32)

    def one_chunk(params: Any, cache: Any, tokens: Any, positions: Any) -> Any:
        # keras-hub's causal mask starts at the update index: a chunk attends to the
        # cache before it and causally within itself.
        import jax.numpy as jnp

        with _weights(causal_lm, params):
            logits, _, kv = causal_lm.call_with_cache(tokens, cache["kv"], positions[0])
        return {"kv": kv}, logits.astype(jnp.float32)

    lm_tokenizer = getattr(causal_lm.preprocessor, "tokenizer", None)
    if eos_id is None:
        eos_id = getattr(lm_tokenizer, "end_token_id", None)
    # keras-hub's generate stops at its second end token too (Llama 3's <|eot_id|>)
    second = getattr(lm_tokenizer, "end_token2_id", None)
    if second is not None and "stop_ids" not in options:
        options["stop_ids"] = [int(second)]
    options.setdefault("chunk_lengths", sorted({min(prefill_lengths), max(prefill_lengths)}))
    with tempfile.TemporaryDirectory() as tmp:
        if tokenizer is None and lm_tokenizer is not None:
            tokenizer = carried_tokenizer(lm_tokenizer, tmp)
            if tokenizer is not None:
                options.setdefault("start_ids", start_ids_of(causal_lm.preprocessor))
        return export_decoder(
            prefill, per_slot(in_place(one_sequence, 1)), params_of(causal_lm), path,
            cache={"kv": spec}, extend=per_slot(in_place(one_chunk, 1)), max_length=max_length,
            slots=slots,
            prefill_lengths=prefill_lengths, prefill_batches=prefill_batches,
            eos_id=eos_id, tokenizer=tokenizer, **options,
        )  # fmt: skip
