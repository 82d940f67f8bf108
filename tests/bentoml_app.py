"""BentoML with a pxrt model, as a user starts it (docs/integrations.md):
``PXRT_TEST_ARTIFACT=DIR bentoml serve bentoml_app:MLP --working-dir tests``."""

import os

from serving.integrations.bentoml import pxrt_service

MLP = pxrt_service(os.environ["PXRT_TEST_ARTIFACT"], max_delay_us=2000)
