"""Launch: compose the components into a run (local processes, or Ray actors).

Holds no component logic: it turns one run config into each component's config
(:mod:`~astraflow.launch.plan`) and starts, supervises and stops the components.
"""
