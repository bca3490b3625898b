"""Held-out evaluation: a reader of the weight store that scores versions of a policy.

Like a rollout node it only reads weights; unlike one it never trains anything: per evaluated
version (milestones while the policy trains, the final one, or one chosen afterwards) it
appends greedy accuracy, avg@k and pass@k of each held-out set to a JSONL file, which the
launcher's progress view and plots read.
"""
