"""gRPC: the service's methods, pxrt's own HTTP/2 server and HPACK."""
