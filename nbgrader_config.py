"""nbgrader settings for JupyterLab started from the repository root (`make lab`): the course's name, nothing else.

nbgrader's JupyterLab extensions look for an nbgrader_config.py in the folder JupyterLab starts in, and log "No
nbgrader_config.py file found" when there is none. The graded course is configured in
assignments/nbgrader_config.py: run nbgrader commands from that folder (or the autograder, `python -m autograder`).
"""

c = get_config()  # noqa: F821  (nbgrader injects get_config)
c.CourseDirectory.course_id = "labkit"
