"""What the lab notebooks' test cells import, `from autograder.harness import grade`, wherever a notebook runs.

The name is the notebooks' in all three places: in the instructor's tree it is the trusted harness
(autograder/checks/harness.py, whose names this module gives); inside the sandbox autograder/student/kernel_harness.py
stands at this path; in the student release, a harness over the public checks (autograder/release, RELEASE_HARNESS).
`python -m autograder.harness` is the trusted harness's command line, and this module is the grader's default
`--harness` for the trusted re-run of the test cells.
"""

import sys

from autograder.checks.harness import (  # noqa: F401  (the names notebooks, the grader and instructors use)
    ASSIGNMENTS,
    CHECKS,
    STUDENT_FILES,
    CheckFailed,
    NotGradable,
    NotGradableHere,
    checks_for,
    grade,
    main,
    run_check,
    run_checks,
    student_file_from_notebook,
)

if __name__ == "__main__":
    sys.exit(main())
