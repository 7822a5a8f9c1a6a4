"""``dpcfl certs``, ``dpcfl server``, ``dpcfl client``, ``dpcfl submit``, ``dpcfl topology``
and ``dpcfl data``: real silos, one module each (:mod:`.server_command`,
:mod:`.silo_command`, :mod:`.submit_command`, :mod:`.topology_command`,
:mod:`.data_command`; what they share: :mod:`.supervision`).

Each command checks everything it can before it starts anything, prints what it will do, and
then hands over to Flower's own ``flower-superlink`` / ``flower-supernode``.
"""

from __future__ import annotations

from .data_command import data_app
from .server_command import certs, server
from .silo_command import client
from .submit_command import submit
from .topology_command import topology_app

__all__ = ["certs", "client", "data_app", "server", "submit", "topology_app"]
