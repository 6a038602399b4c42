"""The public half of the grader: what runs inside the sandbox, next to a student's code.

Nothing here decides a grade. `runner` imports the student's file and answers requests from the trusted side
over one socket (`channel`: JSON and raw tensor bytes, never pickle); each `labN` module holds the probes the
trusted checks ask for: they call the student's functions on inputs the trusted side sends and return what
came out. The trusted side (autograder.harness and the labN_checks modules, never visible in the sandbox)
computes the reference itself, compares, times every request from outside, and writes the verdict.
Everything in this folder is public: reading it reveals no hidden case, because hidden inputs arrive only at
grading time.
"""
