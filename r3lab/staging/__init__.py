"""Staging: routes from the driver to every trainer rank, one encoded chunk per (DP rank, mini-batch), bounded waits.

Why: a process that holds the whole batch's routes is the failure users hit most at scale (slime #2384:
every Megatron rank got the full ``rollout_routed_experts`` and ran out of host memory; SkyRL #1376:
~30 GB through Ray's object store, every worker deserializing everything, ranks skewed by minutes until
NCCL's 600 s timeout tripped). Here the driver slices the batch by the index plan of
:mod:`r3lab.slicing` and puts one r3lab-encoded bytes object per chunk; each rank fetches only its own
chunk, decodes it (zero-copy for the ``raw`` codec on Ray: the routes are a view of the object store's
shared memory) and hands it to :func:`~r3lab.slicing.shard_local`::

    plan = StagingPlan.build(len(routes), layout, mini_batches=2)           # driver
    staged, stats = stage(routes, plan, RayBackend(), codec="raw")          # one object per chunk
    share, rstats = receive(staged, RankCoords(dp=1, pp=0), mini_batch=0, timeout=60)   # on a rank
    arrays = shard_local(share, layout, pp_rank=0, cp_rank=0, tp_rank=0, micro_batch=0)

**Chunks.** Chunk ``(dp_rank, mini_batch)`` holds the sequences DP rank ``dp_rank`` trains on in that
mini-batch, in micro-batch order (exactly :func:`~r3lab.slicing.dp_share` of the mini-batch). Every
PP/CP/TP rank of that DP rank fetches the same chunk, or, with ``split_stages=True``, one chunk per
``(dp_rank, pp_rank, mini_batch)`` holding only the layers that pipeline stage builds.

**Bytes of a chunk**: see :mod:`r3lab.staging.frame` (format version :data:`CHUNK_VERSION`).
No pickled Python objects of routes travel (on Ray the chunk is a uint8 numpy array, stored out of
band). A receiving rank checks both checksums *and* that the chunk is the one it expects (stage id,
DP rank, mini-batch, stage, sequence ids, token count, layer ids), so a mix-up is caught, not trained on.

**All or none.** Every rank's wait has a deadline. Each rank reports to a coordinator (a thread-safe
object locally, a threaded Ray actor on Ray, keys in the process group's store on torch.distributed)
whether it got a good chunk; :func:`barrier` passes only
when every rank of the layout reported success. If any rank cannot get its chunk in time, gets a
corrupt or wrong one, or never reports, every rank raises the same :class:`~r3lab.errors.StagingError` naming the
rank and chunk, before any rank could enter a collective and hang. A rank returns or raises within
``timeout + grace`` seconds.

**Backends** (each implements the :class:`Backend` protocol; code written against one runs unchanged
on the others): :class:`LocalBackend` (a dict in this process, for CPU notebooks and tests; ranks are
threads, or one thread calling :func:`fetch` for every rank, then :func:`barrier`), :class:`RayBackend`
(Ray's object store; ``ray`` is imported only there) and :class:`TorchDistBackend` (the driver joins the
trainer ranks' process group and sends each rank its chunk: gloo on CPU, NCCL with device tensors on GPU
nodes; ``torch`` is imported only there).

**Modules.** :mod:`~r3lab.staging.plan` (which sequences each chunk holds), :mod:`~r3lab.staging.frame`
(a chunk's bytes), :mod:`~r3lab.staging.coordinator` (the all-or-none tally),
:mod:`~r3lab.staging.backend` (the protocol), :mod:`~r3lab.staging.local`, :mod:`~r3lab.staging.ray_store`
and :mod:`~r3lab.staging.torch_dist` (the backends), :mod:`~r3lab.staging.driver` (:func:`stage`) and
:mod:`~r3lab.staging.rank` (:func:`fetch`, :func:`barrier`, :func:`receive`); :mod:`~r3lab.staging.device_decode`
(a route buffer decoded straight into device memory with torch operations: raw, bitpack, topk-gaps).
"""

from r3lab.staging.backend import Backend, WaitResult
from r3lab.staging.coordinator import Coordinator
from r3lab.staging.driver import StagedBatch, StageStats, stage
from r3lab.staging.frame import CHUNK_MAGIC, CHUNK_VERSION, decode_chunk, encode_chunk
from r3lab.staging.local import LocalBackend
from r3lab.staging.plan import ChunkSpec, RankCoords, StagingPlan
from r3lab.staging.rank import ReceiveStats, barrier, default_grace, fetch, receive
from r3lab.staging.ray_store import RayBackend
from r3lab.staging.torch_dist import StoreTally, TorchDistBackend

__all__ = [
    "RankCoords",
    "ChunkSpec",
    "StagingPlan",
    "StageStats",
    "ReceiveStats",
    "StagedBatch",
    "Backend",
    "WaitResult",
    "Coordinator",
    "LocalBackend",
    "RayBackend",
    "TorchDistBackend",
    "StoreTally",
    "stage",
    "fetch",
    "barrier",
    "receive",
    "default_grace",
    "encode_chunk",
    "decode_chunk",
    "CHUNK_MAGIC",
    "CHUNK_VERSION",
]
