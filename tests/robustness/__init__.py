"""Hostile and heavy conditions: the fuzzer and the soak (tests/harness/), issue 9's edges against werkzeug and
gunicorn, a CPU burner beside live traffic, and container limits. Marker `robustness`."""
