"""A TLS terminator for a test server that speaks only plain text (tests/redis_server.py puts one
in front of a Redis built without TLS, the way stunnel fronted Redis before 6.0):

    client --mutual TLS--> 127.0.0.1:port (this) --plain TCP--> 127.0.0.1:backend_port

It requires what `redis-server --tls-auth-clients yes` requires: a client certificate signed by
the test CA, and it presents the server certificate of tests/tls_certs.py. A client refused in
the handshake never reaches the backend. Connections are piped byte for byte both ways; when
either side closes, so does the other. It runs on an event loop of its own thread, so that the
code under test may use any loop, or none.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import Iterator

from tests.tls_certs import CertFiles

CHUNK_BYTES = 64 * 1024
STOP_TIMEOUT_S = 10.0


def server_context(certs: CertFiles) -> ssl.SSLContext:
    """Mutual TLS: our certificate, and a client certificate verified against the CA."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs.ca))
    context.load_cert_chain(str(certs.cert), str(certs.key))
    context.verify_mode = ssl.CERT_REQUIRED
    return context


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK_BYTES):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


class _Terminator:
    """The asyncio side: accept, connect to the backend, pipe; close() ends every connection."""

    def __init__(self, backend_port: int) -> None:
        self.backend_port = backend_port
        self.tasks: set[asyncio.Task] = set()
        self.server: asyncio.Server | None = None

    async def start(self, port: int, context: ssl.SSLContext) -> None:
        self.server = await asyncio.start_server(self._connected, "127.0.0.1", port, ssl=context)

    async def _connected(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.tasks.add(task)
        backend_writer = None
        try:
            backend_reader, backend_writer = await asyncio.open_connection(
                "127.0.0.1", self.backend_port)
            # a reset or an abrupt TLS close on either side ends both pipes
            await asyncio.gather(_pipe(reader, backend_writer), _pipe(backend_reader, writer),
                                 return_exceptions=True)
        except OSError:
            pass  # no backend: the client's connection closes, as a stopped server's would
        finally:
            writer.close()
            if backend_writer is not None:
                backend_writer.close()
            self.tasks.discard(task)

    async def close(self) -> None:
        """Stop listening (at once: the listening socket closes here) and end every piped
        connection."""
        if self.server is not None:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@contextlib.contextmanager
def tls_terminator(certs: CertFiles, port: int, backend_port: int) -> Iterator[None]:
    """Listen on 127.0.0.1:`port` (bound when this returns) and pipe every mutual-TLS client to
    127.0.0.1:`backend_port`; on exit stop listening and close every connection."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=f"tls-terminator-{port}",
                              daemon=True)
    thread.start()
    terminator = _Terminator(backend_port)
    try:
        asyncio.run_coroutine_threadsafe(terminator.start(port, server_context(certs)),
                                         loop).result(STOP_TIMEOUT_S)
        yield
    finally:
        try:
            asyncio.run_coroutine_threadsafe(terminator.close(), loop).result(STOP_TIMEOUT_S)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(STOP_TIMEOUT_S)
            if not thread.is_alive():
                loop.close()
