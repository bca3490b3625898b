"""Agent environments: the text-environment protocol, its registry, adapters and server.

Depends on the shared layers only (records, config, plugins, errors): never torch, never a
component. The ``env`` workflow (``astraflow.workflows.env``) drives these with a policy.

    protocol.py     Environment / AsyncEnvironment (gymnasium semantics with text), info keys,
                    env_traits, as_async, check_reset / check_step
    registry.py     ENVS (plug-in registry), EnvFactory (one instance per episode)
    turns.py        TurnLimitedEnv: turn count, truncation and end-of-episode info of the
                    shipped text environments (shop, textcraft, search_agent, nim, household)
    gridnav.py      ``gridnav``: walk to a goal on a small grid (the CPU recipe)
    gym_adapter.py  ``gymnasium``: any gymnasium.Env with text observation/action spaces
    remote.py       ``remote``: an environment served by ``astraflow env serve`` (OpenEnv wire)
    server.py       the OpenEnv-wire HTTP server (sessions, auth, idle expiry)
"""

from astraflow.envs.protocol import (
    ADMISSIBLE_ACTIONS,
    INVALID_ACTION,
    SUCCESS,
    AsyncEnvironment,
    Environment,
    EnvTraits,
    Message,
    Observation,
    StepResult,
    as_async,
    check_reset,
    check_step,
    env_traits,
)
from astraflow.envs.registry import ENVS, EnvFactory, EnvSpec

__all__ = [
    "ADMISSIBLE_ACTIONS",
    "ENVS",
    "INVALID_ACTION",
    "SUCCESS",
    "AsyncEnvironment",
    "EnvFactory",
    "EnvSpec",
    "EnvTraits",
    "Environment",
    "Message",
    "Observation",
    "StepResult",
    "as_async",
    "check_reset",
    "check_step",
    "env_traits",
]
