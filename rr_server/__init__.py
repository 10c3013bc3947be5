"""rr's server side: ``serving/`` (what every rr server speaks), the sidecar ``proxy/``, launchers, doctor, demo."""
