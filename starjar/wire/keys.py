"""The wire contract's names, in one place both sides import: every gRPC metadata key and every reason a
server gives for refusing or ending a call (the trailing `starjar-reason`, the HTTP error's `code`)."""

from __future__ import annotations

# Metadata keys.
AUTH_METADATA = "authorization"  # "Bearer <token>" on every RPC (the cluster token, or the user's at the front end)
TAG_METADATA = "starjar-tag"  # a draft stream's session tag, lowercase hex
REASON_METADATA = "starjar-reason"  # trailing: why a call was refused
FIELD_METADATA = "starjar-field"  # trailing: the request field an INVALID_ARGUMENT is about

# Reasons a draft server refuses an Attach or ends a session.
ADMISSION = "admission"  # N_max targets are attached
CALLER = "caller"  # this caller holds its cap of sessions
WORKER_ID = "worker_id"  # a live session holds this worker id
REPLACED = "replaced"  # the session's worker attached again (its restart got the slot back)
FINGERPRINT = "fingerprint"  # the target's tokenizer is not the draft's
# Reasons any server refuses a call.
DRAINING = "draining"  # shutting down: new work is refused while work in flight finishes
QUEUE_FULL = "queue_full"  # a bounded queue is full
FRONT_END_FULL = "front_end_full"  # the front end relays max_requests already
TIMEOUT = "timeout"  # the front end's request_timeout_s passed


def refusal_reason(exc) -> str | None:
    """The reason a server put in a failed call's trailing metadata, if any."""
    metadata = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return dict(metadata or ()).get(REASON_METADATA)
