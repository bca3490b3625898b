"""Workflows: async programs that run a task with named policies and tools, and reward it.

Depends on the shared records only; rollout nodes run workflows, the dataflow service reads
the task generators (``workflows.tasks``) as task sources.
"""
