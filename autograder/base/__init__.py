"""The floor every phase stands on: escaping of student strings, progress lines, nbgrader's start, fault causes, the spool, the course secret, notebook size limits. Any phase may import it."""
