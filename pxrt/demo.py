"""The built-in demo model: a 3-layer GELU MLP, 256 wide, float32."""

from __future__ import annotations

import numpy as np

from .artifact import TensorSpec

WIDTH = 256
LAYERS = 3
BUCKETS = (1, 8, 64, 256)


def mlp(params, x):
    """``x: [n, 256] -> {"y": [n, 256]}``."""
    import jax

    for w, b in params:
        x = jax.nn.gelu(x @ w + b)
    return {"y": x}


def make_params(seed: int = 0, width: int = WIDTH, layers: int = LAYERS) -> list:
    rng = np.random.default_rng(seed)
    return [
        (
            (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
            (0.1 * rng.standard_normal(width)).astype(np.float32),
        )
        for _ in range(layers)
    ]


def spec(width: int = WIDTH, layers: int = LAYERS) -> dict:
    """The demo model as ``pxrt export`` takes a model: ``pxrt export pxrt.demo:spec DIR``."""
    return {
        "fn": mlp,
        "params": make_params(width=width, layers=layers),
        "inputs": {"x": TensorSpec((width,), "float32")},
        "batch_buckets": BUCKETS,
        "name": "mlp",
    }


def export_demo(
    path: str,
    *,
    buckets=BUCKETS,
    width: int = WIDTH,
    layers: int = LAYERS,
    overwrite: bool = True,
) -> str:
    """Export the demo MLP (``layers`` x ``width``) to ``path``."""
    from .artifact import export

    return export(
        mlp,
        make_params(width=width, layers=layers),
        path,
        inputs={"x": TensorSpec((width,), "float32")},
        batch_buckets=buckets,
        name="mlp",
        overwrite=overwrite,
    )
