"""The protocol's data plane, shared by every transport: the ``Backend`` seam, the
request core, the codecs and documents, generation."""
