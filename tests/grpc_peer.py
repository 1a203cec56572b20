"""A gRPC peer for tests of our channels: the standard health service on a loopback port, in
this process (started and stopped at will) or in a process of its own (to be stopped with
SIGSTOP)."""

from __future__ import annotations

import subprocess
import sys

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from ferry.services.common.channels import server_options

_PROCESS = """
import asyncio, sys
from tests.grpc_peer import serve

async def main():
    server = await serve(int(sys.argv[1]))
    print("serving", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


async def serve(port: int) -> grpc.aio.Server:
    """The health service on 127.0.0.1:``port``, with our servers' options."""
    server = grpc.aio.server(options=server_options())
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def serve_in_process(port: int) -> subprocess.Popen[str]:
    """``serve`` in a child process; returns once it serves."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _PROCESS, str(port)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "serving\n"
    return proc
