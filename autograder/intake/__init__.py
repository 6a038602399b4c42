"""Who handed in what, and when: submissions found in an LMS download, its file names, late stamps, shards."""
