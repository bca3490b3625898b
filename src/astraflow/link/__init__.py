"""WAN link emulation: a user-space TCP relay with delay, bandwidth, jitter and loss.

A shared tool rather than a component (it imports none): the launcher puts remote pools
behind one (``PoolSection.link``), benchmarks and tests use ``Link`` directly, and
``astraflow link serve`` runs one alone. ``measure`` checks a link against its configuration.
"""

from __future__ import annotations

from astraflow.link.config import LinkConfig
from astraflow.link.probe import Fidelity, ProbeServer, measure
from astraflow.link.relay import Forward, Link, LinkStats

__all__ = ["Fidelity", "Forward", "Link", "LinkConfig", "LinkStats", "ProbeServer", "measure"]
