"""astraflow: dataflow-oriented reinforcement learning for agentic LLMs.

Rollout nodes (RaaS), the dataflow service and trainers are autonomous components that meet
only at a data interface (``astraflow.dataflow.client``) and a weight interface
(``astraflow.weights``); ``docs/interfaces.md`` pins that contract in code terms.
"""

__version__ = "0.1.0"
