"""rr package."""
