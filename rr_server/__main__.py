"""``python -m rr_server`` == ``rr-server``."""

import sys

from rr_server.cli import main

sys.exit(main())
