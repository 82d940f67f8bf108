"""pxrt inside the inference servers teams already run: each module plugs a pxrt model
into one framework, with the framework as an extra of its own (``pip install
'pxrt[kserve]'``); none is imported by pxrt or ``serving`` themselves."""
