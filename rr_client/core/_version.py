"""rr's own version, in a module that imports nothing (servers report it in ``/rr/info``)."""

__version__ = "0.1.0"
