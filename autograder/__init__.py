"""Trusted grading code for the course's nbgrader labs (assignments/).

`autograder.harness` runs a student's file in a fresh Python process, checks correctness first and only then
measures speed against a baseline timed in the same process; the `labN_*` modules hold each lab's trusted
reference, baseline and checks. Nothing here runs at import time.
"""
