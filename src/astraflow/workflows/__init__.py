"""Workflows: async programs that run a task with named policies and tools, and reward it.

Depends on the shared records only (never torch, never a component); rollout nodes run
workflows, the dataflow service reads the task generators (``workflows.tasks``) as sources.

    api.py            PolicyHandle, Generation, Workflow, Tool, Trajectory (token accounting)
    registry.py       WORKFLOWS: rlvr, tool_calling, solver_verifier, solver_selector,
                      solver_testgen (rlvr.py, tool_calling.py, multi_policy.py, testgen.py)
    rewards.py        REWARDS: exact, EM/F1, math (mathcheck.py), code (sandbox.py)
    tools.py          TOOLS: calculator, search (over corpus.py)
    tasks/            GENERATORS: synthetic, reasoning-gym, HumanEval, search QA, HF datasets
"""
