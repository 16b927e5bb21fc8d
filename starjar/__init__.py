"""starjar: speculative decoding as a shared, distributed service.

This package is the shared library and the public SDK. It imports no other
package of the project (controller, draft_server, target_worker).
"""

__version__ = "0.1.0"

from starjar.errors import InvalidArgument, StarjarError
from starjar.sampling import SamplingParams

__all__ = ["InvalidArgument", "SamplingParams", "StarjarError", "__version__"]
