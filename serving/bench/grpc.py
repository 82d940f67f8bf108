"""``pxrt bench --url grpc://HOST:PORT``: the same runs over KServe v2's gRPC protocol
(``ModelInfer``), against pxrt serve or any other server that speaks it (Triton).

The request is a ``ModelInferRequest`` with its tensors as raw contents, serialized
once; calls go through one grpcio channel (HTTP/2 multiplexes the concurrent calls)
with bytes in and out, so no message is built or parsed per call. The server's stage
breakdown comes from ``ModelStatistics``, as over HTTP. Needs the ``grpc`` extra
(grpcio, tritonclient's protos).
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from .inputs import random_inputs, read_input_data

SERVICE = "/inference.GRPCInferenceService/"
MAX_MESSAGE = 256 << 20


class GrpcClient:
    """A target's calls: ``infer(bytes)`` is one ``ModelInfer`` call, on a lean HTTP/2
    connection (``serving.bench.h2client``; grpcio for requests over its first flow
    window), ``metadata`` and ``statistics`` through grpcio."""

    def __init__(self, address: str) -> None:
        import grpc

        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
        ]
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=options)
        self._infer: Any = self.channel.unary_unary(SERVICE + "ModelInfer")
        self.metadata: Any = self.channel.unary_unary(SERVICE + "ModelMetadata")
        self.statistics: Any = self.channel.unary_unary(SERVICE + "ModelStatistics")
        self._conn: Any = None
        self._connecting: asyncio.Lock | None = None

    async def _connection(self) -> Any:
        from .h2client import connect

        if self._conn is None or self._conn.lost is not None:
            if self._connecting is None:
                self._connecting = asyncio.Lock()
            async with self._connecting:
                if self._conn is None or self._conn.lost is not None:
                    host, _, port = self.address.rpartition(":")
                    self._conn = await connect(host, int(port))
        return self._conn

    async def infer(self, data: bytes) -> bytes:
        conn = await self._connection()
        if len(data) + 5 > conn.peer_window:
            return await self._infer(data)
        return await conn.unary(_INFER, data)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        await self.channel.close()


_INFER = (SERVICE + "ModelInfer").encode()


class GrpcTarget:
    """A model on a running gRPC server, and one prepared request for it (the same
    interface as ``serving.bench.http.Target``)."""

    mode = "grpc"
    kind = "gRPC"
    binary = True

    def __init__(
        self,
        url: str,
        model: str,
        rows: int,
        shapes: dict[str, list[int]] | None = None,
        input_data: str | None = None,
    ) -> None:
        parts = urlsplit(url)
        self.shapes = shapes or {}
        self.input_data = input_data
        self._data: list[bytes] = []
        self._next = 0
        self.url = url
        self.address = f"{parts.hostname or '127.0.0.1'}:{parts.port or 8001}"
        self.model = model
        self.rows = rows
        self.meta: dict = {}
        self._requests: dict[int, bytes] = {}
        self._stats_client: GrpcClient | None = None

    def client(self, connections: int) -> GrpcClient:
        return GrpcClient(self.address)

    async def aclose(self) -> None:
        if self._stats_client is not None:
            await self._stats_client.close()
            self._stats_client = None

    async def prepare(self, session: Any = None) -> None:
        import grpc
        from google.protobuf import json_format
        from tritonclient.grpc import service_pb2 as pb

        client = GrpcClient(self.address)
        try:
            raw = await client.metadata(
                pb.ModelMetadataRequest(name=self.model).SerializeToString()
            )
        except grpc.aio.AioRpcError as exc:
            raise SystemExit(
                f"pxrt bench: {self.url} has no model {self.model!r} ({exc.details()})"
            ) from None
        finally:
            await client.close()
        self.meta = json_format.MessageToDict(pb.ModelMetadataResponse.FromString(raw))
        if self.meta.get("platform") == "pxrt_jax_decoder":
            raise SystemExit(  # (pxrt bench measures it with serving.bench.generate)
                f"pxrt bench: {self.model!r} is a decoder: --compare and --client-procs "
                "measure one-shot models"
            )
        self.load_bodies()

    def load_bodies(self) -> None:
        """Build the requests once the metadata is in."""
        if self.input_data:
            meta = {"inputs": [s | {"shape": [int(d) for d in s["shape"]]}
                               for s in self.meta["inputs"]]}  # fmt: skip
            self._data = [
                self._encode(r) for r in read_input_data(self.input_data, meta, self.rows)
            ]
        else:
            self._requests[self.rows] = self._make(self.rows)

    def _make(self, rows: int) -> bytes:
        meta = {
            "inputs": [s | {"shape": [int(d) for d in s["shape"]]} for s in self.meta["inputs"]]
        }
        return self._encode(random_inputs(meta, rows, self.shapes, seed=rows))

    def _encode(self, values: dict[str, np.ndarray]) -> bytes:
        """A serialized ModelInferRequest carrying ``values`` as raw contents."""
        from tritonclient.grpc import service_pb2 as pb

        request = pb.ModelInferRequest(model_name=self.model)
        for spec in self.meta["inputs"]:
            x = np.ascontiguousarray(values[spec["name"]])
            request.inputs.add(name=spec["name"], datatype=spec["datatype"], shape=x.shape)
            request.raw_input_contents.append(x.tobytes())
        return request.SerializeToString()

    async def call(self, client: GrpcClient, rows: int | None = None) -> None:
        if self._data:  # an input-data file's requests, in turn
            data = self._data[self._next % len(self._data)]
            self._next += 1
            await client.infer(data)
            return
        n = rows or self.rows
        request = self._requests.get(n)
        if request is None:
            request = self._requests[n] = self._make(n)
        await client.infer(request)  # (an error status raises)

    async def stats(self, session: Any = None) -> dict | None:
        """This model's statistics in the HTTP endpoint's shape (numbers as ints)."""
        from google.protobuf import json_format
        from tritonclient.grpc import service_pb2 as pb

        if self._stats_client is None:
            self._stats_client = GrpcClient(self.address)
        try:
            raw = await self._stats_client.statistics(
                pb.ModelStatisticsRequest(name=self.model).SerializeToString()
            )
        except Exception:  # noqa: BLE001 - no breakdown, the run still counts
            return None
        doc = json_format.MessageToDict(
            pb.ModelStatisticsResponse.FromString(raw), preserving_proto_field_name=True
        )
        stats = (doc.get("model_stats") or [None])[0]
        if stats is None:
            return None
        inference = {
            k: {"count": int(v.get("count", 0)), "ns": int(v.get("ns", 0))}
            for k, v in stats.get("inference_stats", {}).items()
        }
        for k in ("queue", "compute_input", "compute_infer", "compute_output"):
            inference.setdefault(k, {"count": 0, "ns": 0})
        return {
            "inference_stats": inference,
            "execution_count": int(stats.get("execution_count", 0)),
            "inference_count": int(stats.get("inference_count", 0)),
        }


__all__ = ["GrpcClient", "GrpcTarget"]
