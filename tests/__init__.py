"""rr's tests, one folder per tier by what a test needs (each folder's docstring says what it tests and needs)."""
