"""KServe's ModelServer with a pxrt model, as a user starts it (the five lines of
docs/integrations.md): ``python tests/kserve_app.py NAME ARTIFACT --http_port P``
(KServe reads its own flags from the command line). It serves the artifact twice:
as NAME, its REST inference answered by pxrt's own v2 endpoint (the default), and as
NAME-kserve through KServe's ``predict`` (``native_v2=False``)."""

import sys

import kserve

from serving.integrations.kserve import PxrtModel

if __name__ == "__main__":
    name, path = sys.argv[1], sys.argv[2]
    del sys.argv[1:3]  # (the rest are KServe's flags)
    native = PxrtModel(name, path, max_delay_us=2000)
    through_kserve = PxrtModel(f"{name}-kserve", path, native_v2=False, max_delay_us=2000)
    native.load()
    through_kserve.load()
    kserve.ModelServer().start([native, through_kserve])
