"""ps_daemon/rpc/status.py's pieces that need no server: undecodable requests and the
rate-limited log of refusals (tests/integration/test_bad_input.py runs them in a daemon)."""

from __future__ import annotations

import logging

from ps_offload.daemon.errors import InvalidArgument
from ps_offload.daemon.rpc.status import RateLimitedLog, Undecodable
from ps_offload.proto import ps_pb2


def test_a_decoder_returns_the_message_or_what_to_answer_for_bytes_that_do_not_parse():
    decode = Undecodable.decoder(ps_pb2.PullRequest)
    request = ps_pb2.PullRequest(model="m", shard_id=3)
    assert decode(request.SerializeToString()) == request
    bad = decode(b"\xff\xff\xff")
    assert isinstance(bad, Undecodable) and bad.message == "ps.v1.PullRequest"
    error = bad.error()
    assert isinstance(error, InvalidArgument) and "not a valid ps.v1.PullRequest" in str(error)


def test_refusals_are_logged_once_an_interval_per_method_and_status_with_a_count_of_the_rest(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr("ps_offload.daemon.rpc.status.time.monotonic", lambda: now[0])
    log = RateLimitedLog(interval=10.0)
    with caplog.at_level(logging.INFO, logger="ps_offload.daemon.rpc.status"):
        for _ in range(5):
            log.info("Pull", "NOT_FOUND", "no model 'x'")
        log.info("Push", "NOT_FOUND", "no model 'x'")  # another method: its own line
        now[0] += 10.0
        log.info("Pull", "NOT_FOUND", "no model 'y'")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "Pull -> NOT_FOUND: no model 'x'",
        "Push -> NOT_FOUND: no model 'x'",
        "Pull -> NOT_FOUND: no model 'y' (4 more like it in the last 10s not logged)",
    ]
