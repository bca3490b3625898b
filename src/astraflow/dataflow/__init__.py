"""The dataflow service: task queue, per-policy buffers, plug-ins, regulation and report.

Other components reach it only through :mod:`astraflow.dataflow.client`. Importing this
package (or the client) never imports torch, nor the server's own dependencies.

    config.py  DataflowConfig          service.py  every rule (no HTTP)
    app.py     /v1 routes (Starlette)  store.py    SQLite WAL state
    client.py  sync + async clients    server.py   ``astraflow dataflow serve``
"""

from __future__ import annotations

from astraflow.dataflow.client import AsyncDataflowClient, DataflowClient
from astraflow.dataflow.config import DataflowConfig

__all__ = ["AsyncDataflowClient", "DataflowClient", "DataflowConfig"]
