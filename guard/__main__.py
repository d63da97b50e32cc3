"""``python -m guard``: the ``guard`` command line (:func:`guard.cli.main`)."""

import sys

from guard.cli import main

sys.exit(main())
