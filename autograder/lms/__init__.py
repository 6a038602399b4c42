"""The LMS side of a graded class: gradebook CSV, Gradescope results, feedback bundles to upload."""
