# Types of serving/grpc/_hpack.pyx (HPACK header blocks, RFC 7541) as Python sees it;
# serving/grpc/_hpack_py.py is its pure-Python twin with the same API.
from serving.grpc.hpack_tables import HpackError as HpackError

def huffman_decode(data: bytes | bytearray | memoryview) -> bytes: ...

class Decoder:
    max_table_size: int
    max_list_size: int
    table_size: int
    size: int
    entries: list[tuple[bytes, bytes]]
    def __init__(self, max_table_size: int = 4096, max_list_size: int = 65536) -> None: ...
    def decode(self, block: bytes | bytearray | memoryview) -> list[tuple[bytes, bytes]]: ...
