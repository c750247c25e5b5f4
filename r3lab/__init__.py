"""r3lab: a research workbench for Rollout Routing Replay (R3) in RL of Mixture-of-Experts models.

Stages, one module each, data flowing one way: ``routes`` (the container) -> ``compaction``
(transport) -> ``rollout`` (capture, inference side) | ``slicing`` -> ``replay`` (trainer side).
"""

from r3lab.errors import R3LabError, RouteFormatError
from r3lab.routes import Routes, compact_dtype

__version__ = "0.1.0"
__all__ = ["Routes", "compact_dtype", "R3LabError", "RouteFormatError", "__version__"]
