"""LitServe with a pxrt model, as a user starts it (docs/integrations.md):
``python tests/litserve_app.py ARTIFACT PORT``."""

import sys

import litserve as ls

from serving.integrations.litserve import PxrtLitAPI

if __name__ == "__main__":
    api = PxrtLitAPI(sys.argv[1], max_delay_us=2000)
    ls.LitServer(api, accelerator="cpu").run(port=int(sys.argv[2]), generate_client_file=False)
