"""The generation engine's package (``pxrt/decoder/``): its old import paths still work,
and what a front-end worker imports of it leaves jax out."""

from __future__ import annotations

import subprocess
import sys


def test_the_artifact_names_are_the_packages_too():
    from pxrt import decoder
    from pxrt.decoder import LENGTH_DIM, export

    assert LENGTH_DIM == export.LENGTH_DIM == "length"
    assert decoder.export_decoder is export.export_decoder
    assert decoder.read is export.read


def test_the_request_side_does_not_import_jax():
    code = (
        "import sys, pxrt.decoder, pxrt.decoder.params, pxrt.decoder.request, "
        "pxrt.decoder.prefix, pxrt.generation, pxrt.prefix\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
