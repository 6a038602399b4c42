"""How big a notebook the grader takes: intake refuses a hand-in past these, and feedback will not render one."""

MAX_CELLS = 5000  # cells in a notebook formgrader is given (a course notebook has tens)
MAX_OUTPUTS = 20000  # outputs in all its cells
