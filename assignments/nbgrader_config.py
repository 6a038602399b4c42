"""nbgrader configuration of the course's graded labs (run nbgrader commands from this folder).

Grading policy, in short (README.md here has the long form): every test cell calls the trusted harness
(`autograder.harness.grade`), which runs the student's `%%writefile` module in a sandboxed process; speed points
need a correct result first; a check that this machine cannot grade (a GPU speed tier on a CPU) scores 0 under
`nbgrader autograde` with a message saying so, and does not fail `nbgrader validate`.
"""

import os

c = get_config()  # noqa: F821  (nbgrader injects get_config)

# The labs, in course order, are source/<id>/<id>.ipynb with ids lab1_loss_scaling, lab2_data_pipeline,
# lab3_profile_fix and lab4_speedrun; `nbgrader generate_assignment <id>` adds each to the gradebook.
c.CourseDirectory.course_id = "labkit"
# Files the notebooks write next to themselves (the students' modules, scratch data) never travel with a release.
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback", "student_*.py", "scratch*"]

# Per-cell limit (nbgrader's own default is 30 s; ExecutePreprocessor.timeout is ignored by nbgrader). Under
# nbgrader the first test cell runs all of a lab's checks in one process, and on a GPU the ResNet-18 speedrun
# compiles the student's step twice, so the limit is generous; endless loops are caught by the harness's own
# per-check timeouts first.
c.Execute.timeout = 1800
c.Execute.interrupt_on_timeout = True

# Deleted test or solution cells come back at autograde time instead of silently losing their points.
c.OverwriteCells.add_missing_cells = True

# The code stub a release puts where a solution region was.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# Any stderr output in a test cell scores 0, so keep progress bars and warnings out of the kernels nbgrader
# starts (they inherit this process's environment). The harness also captures its subprocess's stderr.
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")
os.environ.setdefault("MPLBACKEND", "Agg")
