"""The coordinator's requests: each one through a prefill instance (P), then a decode
instance (D), each the least loaded live one of its role (fleet.py):

  1. P gets the request with ``stream: false``, ``max_tokens: 1`` and
     ``kv_transfer_params: {"do_remote_decode": true}`` (vLLM's proxy protocol): it
     prefills the prompt (main layers and the MTP layer), keeps the prompt blocks' KV for
     D, and answers with ``kv_transfer_params`` naming where to pull them;
  2. the coordinator signs those params with the deployment's KV transfer key
     (server/pd/trust.py: D takes no params it did not sign) and D gets the original
     request plus them: it pulls the KV (server/pd/kv_client.py), computes only the
     prompt's tail, and decodes with MTP;
  3. D's answer (streamed or not) is relayed to the client as it comes.

The body is read with the daemon's limits (server/web/body.py: ``clientBodyTimeout``,
``maxRequestLength``); one that is not a JSON object, or nests deeper than
``MAX_JSON_DEPTH``, gets 400.

Failures: a P or D that cannot be reached, or answers 502/503, before it answered is
marked down (until the health loop sees it well again) and the request goes to another
one of its role, if any (for D: with the same signed params); otherwise the client gets
a 503 in the OpenAI error shape, with ``Retry-After``.  A 503 that carries
``Retry-After`` is the instance saying "full, or between roles: later" (its exports are
full, its ``maxLinkNum`` is reached): the request goes to another instance, but this one
stays in rotation, its health checks decide whether it is down.  Before, one "exports
full" answer marked the only P down for every client until the next health check.  Whenever D did not take the request (it refused, none
could, it failed before answering), P is told to drop the exported KV (``POST
/v1/kv/release``, fire and forget).  D failing mid-stream ends the stream with an error
event (its partial output cannot be replayed elsewhere without repeating tokens).  Each
request counts exactly one outcome in ``pd_requests_total``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any, AsyncIterator

import httpx
import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import Counter

from server.web.body import read_json
from server.web.errors import APIError, error_response
from server.web.offload import INLINE_BYTES, off_loop
from server.pd import trust
from server.pd.coordinator.config import CoordinatorConfig, Instance
from server.pd.coordinator.fleet import Fleet

log = logging.getLogger("server.pd")
MAX_JSON_DEPTH = 64          # a body nesting deeper is refused (400)
RELEASE_TIMEOUT_S = 5.0      # a KV release call to P (fire and forget)


def error(status: int, message: str, param: str | None = None,
          retry_after: int | None = None) -> Response:
    """An error in the OpenAI shape (every coordinator error is)."""
    return error_response(status, message, param, retry_after=retry_after)


def json_depth(value: Any) -> int:
    """Nesting depth of a decoded JSON value (a scalar 0, ``{}`` 1), without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        depth = max(depth, d)
        if d > MAX_JSON_DEPTH:
            return d
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return depth


def _check_body(body: Any) -> None:
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(body).__name__}")
    if json_depth(body) > MAX_JSON_DEPTH:
        raise APIError(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels")


class Coordinator(Fleet):
    """The fleet plus the routing of requests, with their counters."""

    def __init__(self, cfg: CoordinatorConfig,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(cfg, transport)
        self._background: set[asyncio.Task] = set()
        self.requests = Counter("pd_requests", "requests by outcome (one per request)",
                                ["outcome"], registry=self.registry)
        self.retries = Counter("pd_retries", "requests sent to another instance after one "
                               "failed", ["role"], registry=self.registry)
        self.releases = Counter("pd_kv_releases", "calls telling P to drop KV that D did not "
                                "take, by result", ["result"], registry=self.registry)
        for outcome in ("ok", "refused", "failed", "bad_request", "cancelled"):
            self.requests.labels(outcome)
        # What a 503 of ours says (Retry-After): the next health check may bring one back.
        self.retry_after_s = max(1, math.ceil(cfg.health_interval_s))

    def unavailable(self, what: str) -> Response:
        return error(503, what, retry_after=self.retry_after_s)

    def _refused_now(self, inst: Instance, status: int, headers: httpx.Headers,
                     text: str) -> bool:
        """Whether an answer means "not this instance, not now" (502, 503): then the request
        goes to another one.  A 503 with Retry-After leaves the instance in rotation; any
        other is marked down until the health loop sees it well."""
        if status not in (502, 503):
            return False
        if status == 503 and "retry-after" in headers:
            log.info("%s is full or between roles: %s", inst.name, text[:200])
        else:
            self.mark_down(inst, f"it answered {status}: {text[:200]}")
        return True

    async def prefill(self, path: str, body: dict, headers: dict, size: int = 0
                      ) -> tuple[Response | None, dict | None, Instance | None]:
        """(error response, None, None) or (None, kv_transfer_params from P, that P)."""
        pbody = dict(body)
        pbody.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        for key in ("stream_options", "min_tokens", "max_completion_tokens"):
            pbody.pop(key, None)
        content = await _dumps(pbody, size)
        for tried, inst in enumerate(self.candidates(self.cfg.prefill)):
            if tried:
                self.retries.labels("prefill").inc()
            self._enter(inst)
            try:
                r = await self.client.post(inst.business + path, content=content, headers=headers)
            except httpx.HTTPError as exc:
                self.mark_down(inst, f"request failed: {exc!r}")
                continue
            finally:
                self._leave(inst)
            if r.status_code != 200:       # the request's own fault (400...) or P's refusal
                if self._refused_now(inst, r.status_code, r.headers, r.text):
                    continue
                return relayed(r.content, r.status_code, r.headers), None, None
            try:
                params = r.json().get("kv_transfer_params")
            except (ValueError, AttributeError):
                params = None
            if not isinstance(params, dict):
                return error(502, f"{inst.name} answered without kv_transfer_params"), None, None
            return None, params, inst
        return self.unavailable("no prefill instance could take the request"), None, None

    async def decode(self, path: str, body: dict, headers: dict, params: dict,
                     p_inst: Instance, size: int = 0) -> Response:
        """D's answer; whenever D did not take the request, P is told to drop its KV."""
        stream = body.get("stream") is True
        content = await _dumps({**body, "kv_transfer_params": trust.sign_params(self.key, params)},
                               size)
        taken = False
        try:
            for tried, inst in enumerate(self.candidates(self.cfg.decode)):
                if tried:
                    self.retries.labels("decode").inc()
                self._enter(inst)
                entered = True
                try:
                    req = self.client.build_request("POST", inst.business + path,
                                                    content=content, headers=headers)
                    try:
                        r = await self.client.send(req, stream=True)
                    except httpx.HTTPError as exc:
                        self.mark_down(inst, f"request failed: {exc!r}")
                        continue
                    if stream and r.status_code == 200:
                        taken, entered = True, False         # _relay leaves
                        return StreamingResponse(self._relay(inst, r),
                                                 media_type="text/event-stream")
                    try:
                        data = await r.aread()
                    except httpx.HTTPError as exc:
                        self.mark_down(inst, f"failed while answering: {exc!r}")
                        return error(502, f"{inst.name} failed while answering")
                    finally:
                        await r.aclose()
                    # role flip, no role yet, overloaded
                    if self._refused_now(inst, r.status_code, r.headers,
                                         data[:200].decode("utf-8", "replace")):
                        continue
                    taken = r.status_code == 200
                    return relayed(data, r.status_code, r.headers)
                finally:
                    if entered:
                        self._leave(inst)
            return self.unavailable("no decode instance could take the request")
        finally:
            if not taken:
                self.release(p_inst, params)

    def release(self, p_inst: Instance, params: dict) -> None:
        """Tell P to drop the KV it holds for D (fire and forget)."""
        rid = params.get("remote_request_id")
        if not isinstance(rid, str):
            return
        task = asyncio.get_running_loop().create_task(self._post_release(p_inst, rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _post_release(self, p_inst: Instance, rid: str) -> None:
        try:
            r = await self.post(p_inst.management + "/v1/kv/release",
                                {"remote_request_id": rid}, RELEASE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            self.releases.labels("failed").inc()
            log.warning("%s: KV release of %s failed: %r", p_inst.name, rid, exc)
            return
        if r.status_code == 200:
            self.releases.labels("ok").inc()
        else:
            self.releases.labels("refused").inc()
            log.warning("%s: KV release of %s answered %d: %s", p_inst.name, rid,
                        r.status_code, r.text[:200])

    async def _relay(self, inst: Instance, r: httpx.Response) -> AsyncIterator[bytes]:
        outcome = "cancelled"                    # the client went away mid-stream
        try:
            async for chunk in r.aiter_raw():
                yield chunk
            outcome = "ok"
        except httpx.HTTPError as exc:
            outcome = "failed"
            self.mark_down(inst, f"failed mid-stream: {exc!r}")
            msg = {"error": {"message": f"{inst.name} failed mid-stream: {exc}",
                             "type": "server_error", "param": None, "code": 502}}
            yield f"data: {json.dumps(msg)}\n\n".encode()
        finally:
            self.requests.labels(outcome).inc()
            await r.aclose()
            self._leave(inst)

    async def handle(self, path: str, request: Request) -> Response:
        counted = False

        def count(outcome: str) -> None:
            nonlocal counted
            counted = True
            self.requests.labels(outcome).inc()

        try:
            try:
                body, size = await read_json(request, self.cfg.max_request_bytes,
                                             self.cfg.body_timeout_s)
                if size <= INLINE_BYTES:
                    _check_body(body)
                else:
                    await off_loop(_check_body, body)
            except (APIError, RecursionError):
                count("bad_request")
                raise
            headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
            headers["content-type"] = "application/json"
            if not self.candidates(self.cfg.decode):   # don't spend a prefill for nothing
                count("failed")
                return self.unavailable("no decode instance is available")
            err, params, p_inst = await self.prefill(path, body, headers, size)
            if err is not None:
                count("failed" if err.status_code >= 500 else "refused")
                return err
            resp = await self.decode(path, body, headers, params, p_inst, size)
            if isinstance(resp, StreamingResponse):
                counted = True                           # _relay counts its outcome
            else:
                count("ok" if resp.status_code == 200 else
                      "failed" if resp.status_code >= 500 else "refused")
            return resp
        except asyncio.CancelledError:
            if not counted:
                count("cancelled")
            raise
        except Exception:
            if not counted:
                count("failed")
            raise

    async def close(self) -> None:
        await self.stop_health_loop()
        if self._background:                     # let pending KV releases finish, briefly
            await asyncio.wait(list(self._background), timeout=RELEASE_TIMEOUT_S)
        await super().close()


async def _dumps(body: dict, size: int) -> bytes:
    """The body to forward (``size``: the client's body's bytes; a large one is encoded
    off the event loop, as it was decoded)."""
    if size > INLINE_BYTES:
        return await off_loop(orjson.dumps, body)
    return orjson.dumps(body)


def relayed(content: bytes, status: int, headers: httpx.Headers) -> Response:
    return Response(content, status, media_type=headers.get("content-type", "application/json"))
