"""starjar: speculative decoding as a shared, distributed service.

This package is the shared library and the public SDK. It imports no other
package of the project (controller, draft_server, target_worker).
"""

from starjar.errors import InvalidArgument, StarjarError
from starjar.spec.sampling import SamplingParams
from starjar.version import __version__


def __getattr__(name):
    # The SDK pulls in grpc; load it only when asked so engine-only users stay light.
    if name in ("Client", "AsyncClient", "GenerationResult", "GenerationChunk", "ClientError", "InvalidRequest",
                "Unavailable", "Timeout", "Unauthenticated", "Overloaded"):
        from starjar import client
        return getattr(client, name)
    raise AttributeError(name)


__all__ = ["AsyncClient", "Client", "ClientError", "GenerationChunk", "GenerationResult", "InvalidArgument",
           "InvalidRequest", "Overloaded", "SamplingParams", "StarjarError", "Timeout", "Unauthenticated",
           "Unavailable", "__version__"]
