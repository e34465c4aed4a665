"""One-off measurements cited by docs/benchmarks.md: where a decode step's time goes (decode_profile.py), what the
4-bit path costs in quality (quality.py), a long prompt beside running streams (long_prompt.py, beside_long.py), and
ARM64 instruction counts under qemu-user (arm64/). The reusable benchmark is bench/ itself (`python -m bench`)."""
