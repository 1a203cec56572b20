"""gRPC transport: ``KvTransfer.Pull`` streams the staged payload in chunks; the fallback for
hosts without UCX. Slower (every byte is copied through protobuf messages), but it needs nothing
beyond grpcio."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from ferry.protos import kv_transfer_pb2 as pb
from ferry.protos import kv_transfer_pb2_grpc as pb_grpc
from ferry.services.common import tls
from ferry.services.common.channels import ChannelPool, server_options
from ferry.services.common.listeners import add_port
from ferry.services.kv_transfer.handle import LeaseNotFound, TransferError
from ferry.services.kv_transfer.staging import as_bytes, checksum
from ferry.services.kv_transfer.transport import KvSink, KvTransport, register

if TYPE_CHECKING:
    from ferry.services.kv_transfer.endpoints import KvExporter
    from ferry.services.kv_transfer.handle import KvHandle

CHUNK_BYTES = 1 << 20  # well under gRPC's 4 MiB message limit


class _Servicer(pb_grpc.KvTransferServicer):
    def __init__(self, exporter: KvExporter, transport: KvTransport) -> None:
        self.exporter = exporter
        self.transport = transport

    async def Pull(
        self, request: pb.KvPullRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvChunk]:
        staged = self.exporter.stage(request.transfer_id)
        if staged is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no lease for transfer {request.transfer_id}"
            )
            return
        payload = staged[0]
        data = as_bytes(payload)
        crc = checksum(payload) if request.checksum else None
        total = len(data)
        for offset in range(0, max(total, 1), CHUNK_BYTES):
            chunk = pb.KvChunk(offset=offset, data=bytes(data[offset : offset + CHUNK_BYTES]))
            if offset == 0:
                chunk.total_bytes = total
                if crc is not None:
                    chunk.checksum = crc
            yield chunk
            if offset == 0 and self.transport.fault_delay_before_payload_s:
                await asyncio.sleep(self.transport.fault_delay_before_payload_s)
        self.exporter.unstage(payload)  # every chunk was copied into its message

    async def Release(
        self, request: pb.KvLeaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.KvLeaseReply:
        return pb.KvLeaseReply(ok=self.exporter.leases.release(request.transfer_id))

    async def Extend(
        self, request: pb.KvLeaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.KvLeaseReply:
        ok = self.exporter.leases.extend(request.transfer_id, request.seconds or None)
        return pb.KvLeaseReply(ok=ok)


@register("grpc")
class GrpcTransport(KvTransport):
    def __init__(self) -> None:
        self._server: grpc.aio.Server | None = None
        self._channels = ChannelPool()

    async def serve(self, exporter: KvExporter, host: str = "127.0.0.1", port: int = 0) -> int:
        self._server = grpc.aio.server(options=server_options())
        pb_grpc.add_KvTransferServicer_to_server(_Servicer(exporter, self), self._server)
        what, creds = "the KV transfer server", tls.server_credentials()
        bound = add_port(self._server, host, port, what, "--kv-port", creds)
        await self._server.start()
        return bound

    def _stub(self, handle: KvHandle) -> pb_grpc.KvTransferStub:
        return pb_grpc.KvTransferStub(self._channels.get(f"{handle.host}:{handle.port}"))

    async def fetch(self, handle: KvHandle, sink: KvSink, want_checksum: bool) -> int | None:
        dst = as_bytes(sink.staged())
        peer = f"{handle.worker_id} at {handle.host}:{handle.port}"
        crc: int | None = None
        received = 0
        try:
            async for chunk in self._stub(handle).Pull(
                pb.KvPullRequest(transfer_id=handle.transfer_id, checksum=want_checksum)
            ):
                if chunk.offset == 0:
                    if chunk.total_bytes != len(dst):
                        raise TransferError(
                            "size",
                            f"transfer {handle.transfer_id}: {chunk.total_bytes} bytes offered, {len(dst)} expected",
                        )
                    crc = chunk.checksum if chunk.HasField("checksum") else None
                end = chunk.offset + len(chunk.data)
                dst[chunk.offset : end] = chunk.data
                received += len(chunk.data)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise LeaseNotFound(handle.transfer_id, peer) from e
            raise TransferError(
                "peer_error",
                f"transfer {handle.transfer_id} from {peer}: {e.code().name} {e.details()}",
            ) from e
        if received != len(dst):
            raise TransferError(
                "truncated",
                f"transfer {handle.transfer_id} from {peer}: {received} of {len(dst)} bytes",
            )
        return crc

    async def release(self, handle: KvHandle) -> None:
        await self._stub(handle).Release(pb.KvLeaseRequest(transfer_id=handle.transfer_id))

    async def extend(self, handle: KvHandle, seconds: float) -> bool:
        reply = await self._stub(handle).Extend(
            pb.KvLeaseRequest(transfer_id=handle.transfer_id, seconds=seconds)
        )
        return bool(reply.ok)

    async def close(self) -> None:
        await self._channels.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)
            self._server = None
