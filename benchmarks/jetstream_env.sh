#!/usr/bin/env bash
# A side venv, .venv-jetstream, for benchmarks/jetstream_compare.py: pxrt and JetStream
# (google-jetstream==0.2.2) in one process, on the same jax/jaxlib/numpy as .venv.
#
#   bash benchmarks/jetstream_env.sh
#   .venv-jetstream/bin/python benchmarks/jetstream_compare.py
#
# - Made with .venv's own python, and every package that .venv also has is held at
#   .venv's version (its `pip freeze` is the constraints file), so jax, jaxlib, numpy,
#   protobuf, grpcio... cannot move.
# - pxrt itself is put on the path with a .pth file pointing at this checkout, not with
#   `pip install -e`: an editable install runs setup.py, which recompiles the Cython
#   extensions in place in the checkout (the ones .venv is using). The side venv uses the
#   extensions .venv built (same python, same numpy): build them with `make` first.
# - google-jetstream is installed with --no-deps, then only what importing
#   jetstream.core.orchestrator needs. Not seqio (it pulls in TensorFlow): the benchmark
#   puts a stub seqio in sys.modules before importing jetstream.
# Idempotent: a second run re-checks the pins and installs nothing new.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="$ROOT/.venv/bin/python"
VENV="$ROOT/.venv-jetstream"
PY="$VENV/bin/python"

if [[ ! -x "$BASE" ]]; then
    echo "jetstream_env: $BASE not found: make the main venv first (make)" >&2
    exit 1
fi

if [[ -x "$PY" ]]; then
    echo "jetstream_env: $VENV exists"
else
    echo "jetstream_env: creating $VENV with $("$BASE" --version) from $BASE"
    "$BASE" -m venv "$VENV"
fi

CONSTRAINTS="$VENV/constraints.txt"
"$BASE" -m pip freeze --exclude-editable --disable-pip-version-check 2>/dev/null \
    | grep -E '^[A-Za-z0-9_.-]+==' >"$CONSTRAINTS"
pin() { grep -i -E "^$1==" "$CONSTRAINTS" || { echo "jetstream_env: $1 not in .venv" >&2; exit 1; }; }
JAX="$(pin jax)"
JAXLIB="$(pin jaxlib)"
NUMPY="$(pin numpy)"
echo "jetstream_env: pinned from .venv: $JAX $JAXLIB $NUMPY (all $(wc -l <"$CONSTRAINTS") of .venv's packages are constraints)"

PIP=(pip_install -q --disable-pip-version-check -c "$CONSTRAINTS")
# pip, less its warnings about configured package locations that this machine lacks.
pip_install() {
    "$PY" -m pip install "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# pxrt's runtime dependencies, read from pyproject.toml ([project] dependencies).
mapfile -t PXRT_DEPS < <("$PY" - "$ROOT/pyproject.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
EOF
)
echo "jetstream_env: installing $JAX $JAXLIB $NUMPY and pxrt's dependencies: ${PXRT_DEPS[*]}"
"${PIP[@]}" "$JAX" "$JAXLIB" "$NUMPY" "${PXRT_DEPS[@]}"

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$ROOT" >"$SITE/pxrt-checkout.pth"
echo "jetstream_env: pxrt from $ROOT (via $SITE/pxrt-checkout.pth)"

echo "jetstream_env: installing google-jetstream==0.2.2 (--no-deps)"
"${PIP[@]}" --no-deps "google-jetstream==0.2.2"

# What `import jetstream.core.orchestrator` (and engine_api, token_utils) needs, less seqio.
JS_DEPS=(flax tiktoken blobfile protobuf absl-py grpcio shortuuid prometheus_client)
echo "jetstream_env: installing JetStream's import-time dependencies: ${JS_DEPS[*]}"
"${PIP[@]}" "$JAX" "$JAXLIB" "$NUMPY" "${JS_DEPS[@]}"

# keras-hub for the keras-llama shape (pxrt.adapters.keras_hub, keras-hub's generate()), as
# the Makefile installs it in .venv: without tensorflow-text (TensorFlow), which causal LMs
# on the JAX backend do not need; tokenizers is what importing keras_hub needs of the rest.
KERAS_DEPS=(keras kagglehub kagglesdk regex rich tokenizers)
echo "jetstream_env: installing keras-hub (--no-deps) and ${KERAS_DEPS[*]}"
"${PIP[@]}" "$JAX" "$JAXLIB" "$NUMPY" "${KERAS_DEPS[@]}"
"${PIP[@]}" --no-deps "$(pin keras-hub)"

echo "jetstream_env: checking"
"$PY" - <<'EOF'
import sys, types
import jax, jaxlib, numpy
for name in ("seqio", "seqio.vocabularies"):
    sys.modules.setdefault(name, types.ModuleType(name))
sys.modules["seqio"].vocabularies = sys.modules["seqio.vocabularies"]
sys.modules["seqio.vocabularies"].SentencePieceVocabulary = type("SentencePieceVocabulary", (), {})
sys.modules["seqio.vocabularies"].Vocabulary = type("Vocabulary", (), {})
import logging
root = logging.getLogger()
handlers, level = list(root.handlers), root.level
from jetstream.core import orchestrator  # noqa: F401
from jetstream.engine import engine_api, token_utils  # noqa: F401
root.handlers[:], root.level = handlers, level
import os
os.environ.setdefault("KERAS_BACKEND", "jax")
import keras_hub  # noqa: F401
from importlib.metadata import version
import pxrt
print(
    f"jetstream_env: ok: jax {jax.__version__}, jaxlib {jaxlib.__version__}, numpy "
    f"{numpy.__version__}, google-jetstream {version('google-jetstream')}, flax "
    f"{version('flax')}, protobuf {version('protobuf')}, keras-hub {version('keras-hub')}, "
    f"pxrt from {pxrt.__file__}"
)
EOF
