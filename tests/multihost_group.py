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

import numpy as np

import pxrt
from pxrt.multihost import Distributed, Follower


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
    loaded = pxrt.load(spec["artifact"], distributed=cfg, progress=False)
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
    with np.load(spec["requests"]) as data:
        requests: dict[int, dict[str, np.ndarray]] = {}
        for key in data.files:
            i, name = key.split("/")
            requests.setdefault(int(i), {})[name] = data[key]
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
    np.savez(spec["out"], **out)
    loaded.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
