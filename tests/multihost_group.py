"""One process of a multi-host group, for tests/test_multihost.py (run as a script, with
its own XLA_FLAGS): ``python tests/multihost_group.py SPEC.json``.

SPEC: coordinator, num_processes, process_id, control_port, artifact, and for the
leader ``requests`` (an .npz of ``"{i}/{input}"`` arrays) and ``out`` (an .npz to write:
``"batch/{i}/{output}"`` from one ``run_batch`` of them all, ``"alone/{i}/{output}"``
from ``run`` of each, and ``"errors"``: a JSON list of [i, message]); for a decoder,
``prompts`` and ``max_tokens`` instead, and ``out`` gets the JSON list of each prompt's
tokens. The leader closes the group when done; a follower follows until then.
"""

from __future__ import annotations

import json
import sys

import ml_dtypes  # noqa: F401 - registers bfloat16 & co. for np.dtype(name)
import numpy as np

import pxrt
from pxrt.multihost import Distributed, Follower


def save(path, arrays: dict) -> None:
    """``np.savez`` that keeps ml_dtypes' dtypes (bfloat16 would come back as void)."""
    dtypes = {k: v.dtype.name if v.dtype.kind == "V" else v.dtype.str for k, v in arrays.items()}
    plain = {
        k: v.view(f"u{v.dtype.itemsize}") if v.dtype.kind == "V" else v for k, v in arrays.items()
    }
    np.savez(path, __dtypes__=np.array(json.dumps(dtypes)), **plain)


def load(path) -> dict:
    with np.load(path) as data:
        dtypes = json.loads(str(data["__dtypes__"]))
        return {k: data[k].view(np.dtype(dtypes[k])) for k in data.files if k != "__dtypes__"}


def main(path: str) -> int:
    with open(path) as f:
        spec = json.load(f)
    cfg = Distributed(
        spec["coordinator"],
        spec["num_processes"],
        spec["process_id"],
        control_port=spec["control_port"],
        connect_timeout_s=120,
    )
    options = spec.get("load_options", {})
    loaded = pxrt.load(spec["artifact"], distributed=cfg, progress=False, **options)
    if isinstance(loaded, Follower):
        loaded.follow()
        return 0
    if "prompts" in spec:  # a decoder: every prompt at once, batched continuously
        gens = [loaded.submit(p, max_tokens=spec["max_tokens"]) for p in spec["prompts"]]
        tokens = [g.result(120).tokens for g in gens]
        with open(spec["out"], "w") as f:
            json.dump(tokens, f)
        loaded.close()
        return 0
    requests: dict[int, dict[str, np.ndarray]] = {}
    for key, value in load(spec["requests"]).items():
        i, name = key.split("/")
        requests.setdefault(int(i), {})[name] = value
    ordered = [requests[i] for i in sorted(requests)]
    out: dict[str, np.ndarray] = {}
    errors = []
    for i, result in enumerate(loaded.run_batch(ordered, return_exceptions=True)):
        if isinstance(result, Exception):
            errors.append([i, str(result)])
            continue
        out.update({f"batch/{i}/{k}": v for k, v in result.items()})
        out.update({f"alone/{i}/{k}": v for k, v in loaded.run(ordered[i]).items()})
    out["errors"] = np.array(json.dumps(errors))
    save(spec["out"], out)
    loaded.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
