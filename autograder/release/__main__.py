"""`python -m autograder.release`: build the student release (autograder.release.build)."""

import sys

from autograder.release.build import main

sys.exit(main())
