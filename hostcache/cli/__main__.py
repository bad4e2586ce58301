"""``python -m hostcache.cli``: the table commands (:func:`hostcache.cli.main`)."""

import sys

from hostcache.cli import main

sys.exit(main())
