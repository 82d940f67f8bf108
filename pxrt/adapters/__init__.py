"""Adapters: export models from the libraries JAX users already have, with no
hand-written ``fn`` or ``prefill``/``decode``. Each imports its library only when used
(``pxrt.adapters.keras_hub``: keras-hub on the JAX backend; ``pxrt.adapters.transformers``:
Hugging Face's Flax causal LMs)."""
