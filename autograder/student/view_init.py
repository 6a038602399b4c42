"""The grader as a sandboxed process sees it: only the public half (`autograder.student`) and a stub harness.

The checks, references, baselines and verdicts are not here: they run in the grader's own process.
"""
