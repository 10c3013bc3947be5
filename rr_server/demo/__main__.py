"""``python -m rr_server.demo``: the quickstart demo (:mod:`rr_server.demo.quickstart`)."""

from rr_server.demo.quickstart import main

raise SystemExit(main())
