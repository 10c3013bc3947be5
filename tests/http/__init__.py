"""Real HTTP on 127.0.0.1 against TEST-ONLY servers and FAKE upstreams, and the sidecar in front of the fakes."""
