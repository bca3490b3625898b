"""Example programs run by the shipped example configs (agents here import nothing from
astraflow: they are what a user writes)."""
