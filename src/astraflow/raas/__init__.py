"""Rollout-as-a-Service: a node that leases tasks, runs workflows and pushes trajectories.

A node hosts one engine per policy (``raas.engines``), exposes each as a
``workflows.api.PolicyHandle`` (``raas.policy``), and runs the loops of ``raas.node``. It
talks to the rest of the system only through ``astraflow.dataflow.client`` (data) and
``astraflow.weights`` (weights). Importing this package is cheap: engines import torch,
vLLM or httpx only when built.
"""
