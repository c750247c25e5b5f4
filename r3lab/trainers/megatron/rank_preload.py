"""What the trainer ranks' fork server imports beyond plain modules (``launch.RANK_PRELOAD`` names this module):
NVIDIA Megatron-Bridge, through r3lab's Transformer Engine stand-in, with its guard run once.

Every Megatron build on Python 3.12 goes through Megatron-Bridge (the default loader), and each rank paid for
importing it (2.4 s of CPU here) and for the guard's scan of its ~1000 source files (0.5 s) at its first build; forked
from a server that did both, a rank starts with ``megatron.bridge`` in ``sys.modules`` and the scan cached. Where
Megatron-Bridge is not installed this does nothing; where its import or guard fails, it leaves the failure to the
rank's own build, which raises it naming what changed (an exception here would end the fork server, and every rank
with it, without that message).
"""

from __future__ import annotations

from r3lab.errors import MegatronBridgeAPIError
from r3lab.trainers.megatron import megatron_bridge_api


def preload() -> bool:
    """Import Megatron-Bridge and run its guard in this process; False (and nothing imported) where it is not
    installed or the guard refuses it."""
    if megatron_bridge_api.installed_version() is None:
        return False
    try:
        megatron_bridge_api.check_megatron_bridge_api()
    except MegatronBridgeAPIError:
        return False
    return True


PRELOADED = preload()
