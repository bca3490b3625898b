"""Held-out evaluation: a reader of the weight store that scores each new version greedily.

Like a rollout node it only reads weights; unlike one it never trains anything: it appends
``{version, created_at, accuracy}`` per evaluated version to a JSONL file, which the
launcher's progress view and plots read.
"""
