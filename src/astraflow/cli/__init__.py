"""The ``astraflow`` console script: one subcommand per component (heavy imports are lazy)."""
