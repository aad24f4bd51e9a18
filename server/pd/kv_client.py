"""D's side of the KV transfer: pull one request's rows from P (wire.py)."""
from __future__ import annotations

import asyncio
import ssl

from server.pd.wire import KVRows, TransferError, pull_line, read_response


async def pull_kv(host: str, port: int, request_id: str, *, connect_timeout_s: float,
                  transfer_timeout_s: float, ssl_ctx: ssl.SSLContext | None = None) -> KVRows:
    """The rows P holds for ``request_id``; TransferError on any failure, within
    ``connect_timeout_s`` (kv_link_timeout) + ``transfer_timeout_s`` (kv_trans_timeout)."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ssl_ctx,
                                    server_hostname=host if ssl_ctx else None),
            timeout=connect_timeout_s)
    except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
        raise TransferError(f"cannot reach the prefill instance's KV port {host}:{port}: "
                            f"{exc or type(exc).__name__}") from None
    try:
        writer.write(pull_line(request_id))
        await writer.drain()
        return await asyncio.wait_for(read_response(reader), timeout=transfer_timeout_s)
    except asyncio.TimeoutError:
        raise TransferError(f"the KV transfer from {host}:{port} took longer than "
                            f"{transfer_timeout_s:g} s (kv_trans_timeout)") from None
    except (OSError, ssl.SSLError) as exc:
        raise TransferError(f"the KV transfer from {host}:{port} failed: {exc}") from None
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except Exception:              # noqa: BLE001
            pass
