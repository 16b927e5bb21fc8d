"""The loops starjar runs gRPC on report errors as asyncio does, except a closed peer loop's late gRPC event."""

import logging

from starjar.service.serving import new_event_loop


class PollerCompletionQueueHandle:
    """Stands for grpc's handle in the report: its repr names the completion queue, as the real one's does."""

    def __repr__(self) -> str:
        return "<Handle functools.partial(<bound method PollerCompletionQueue._handle_events ...>)>"


def _errors(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_late_grpc_event_for_a_closed_loop_is_no_traceback(caplog):
    loop = new_event_loop()
    try:
        with caplog.at_level(logging.DEBUG):
            loop.call_exception_handler({"message": "Exception in callback", "handle": PollerCompletionQueueHandle(),
                                         "exception": RuntimeError("Event loop is closed")})
        assert not _errors(caplog)
        assert any("closed event loop" in r.getMessage() for r in caplog.records)
    finally:
        loop.close()


def test_every_other_error_is_reported_as_asyncio_reports_it(caplog):
    loop = new_event_loop()
    try:
        loop.call_exception_handler({"message": "Exception in callback", "handle": PollerCompletionQueueHandle(),
                                     "exception": RuntimeError("something else")})
        loop.call_exception_handler({"message": "Exception in callback", "exception": RuntimeError(
            "Event loop is closed")})  # not from gRPC's completion queue
        assert len(_errors(caplog)) == 2
    finally:
        loop.close()
