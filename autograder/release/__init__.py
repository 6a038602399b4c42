"""The student release: what students receive, built and scanned for leaks."""
