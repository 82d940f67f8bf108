"""KServe's ModelServer with a pxrt model, as a user starts it (the five lines of
docs/integrations.md): ``python tests/kserve_app.py NAME ARTIFACT --http_port P``
(KServe reads its own flags from the command line)."""

import sys

import kserve

from serving.integrations.kserve import PxrtModel

if __name__ == "__main__":
    name, path = sys.argv[1], sys.argv[2]
    del sys.argv[1:3]  # (the rest are KServe's flags)
    model = PxrtModel(name, path, max_delay_us=2000)
    model.load()
    kserve.ModelServer().start([model])
