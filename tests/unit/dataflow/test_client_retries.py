"""The dataflow clients' one retry policy (``_Base._tries``), driven without a network."""

from __future__ import annotations

import httpx
import pytest

from astraflow.dataflow.client import LEASE, SET_POOL_SIZE, DataflowClient, _Done, _Try
from astraflow.errors import NotFoundError, ServiceUnavailableError
from astraflow.records import LeaseReply, LeaseRequest, PoolSizeRequest

REQ = LeaseRequest(node_id="n1", capacity=1, workflows=["rlvr"])
REPLY = LeaseReply(tasks=[], lease_ttl_s=30.0).model_dump_json()


def _response(status: int, body: str = "{}") -> httpx.Response:
    return httpx.Response(status, text=body, request=httpx.Request("POST", "http://df/v1/lease"))


def test_5xx_and_connection_errors_are_retried_then_the_reply_decoded() -> None:
    with DataflowClient("http://df", retries=3) as client:
        tries = client._tries(LEASE(REQ))
        first = next(tries)
        assert isinstance(first, _Try) and first.delay == 0.0
        assert first.request["url"] == "/v1/lease" and first.request["method"] == "POST"
        again = tries.send(httpx.ConnectError("refused"))
        assert isinstance(again, _Try) and again.delay > 0  # backoff before the next try
        assert isinstance(tries.send(_response(503, "busy")), _Try)
        done = tries.send(_response(200, REPLY))
        assert isinstance(done, _Done) and done.value == LeaseReply(tasks=[], lease_ttl_s=30.0)


def test_gives_up_after_its_retries_naming_the_last_error() -> None:
    with DataflowClient("http://df", retries=1) as client:
        tries = client._tries(LEASE(REQ))
        next(tries)
        tries.send(_response(502, "bad gateway"))
        with pytest.raises(ServiceUnavailableError, match="after 2 tries: HTTP 500: bad gateway"):
            tries.send(_response(500, "bad gateway"))


def test_a_4xx_raises_its_error_at_once() -> None:
    body = '{"error": {"code": "not_found", "message": "no such pool", "field": "pool"}}'
    with DataflowClient("http://df", retries=5) as client:
        tries = client._tries(LEASE(REQ))
        next(tries)
        with pytest.raises(NotFoundError, match="no such pool"):
            tries.send(_response(404, body))


def test_a_call_that_is_not_idempotent_is_not_retried_once_sent() -> None:
    req = PoolSizeRequest(pool="gpu", delta=1)
    with DataflowClient("http://df", retries=5) as client:
        tries = client._tries(SET_POOL_SIZE(req, once=True))
        next(tries)
        assert isinstance(tries.send(httpx.ConnectError("refused")), _Try)  # never arrived
        with pytest.raises(ServiceUnavailableError, match="may or may not have been applied"):
            tries.send(httpx.ReadTimeout("no reply"))
