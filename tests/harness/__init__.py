"""Test infrastructure that drives a live server: the fuzzer, the soak and the load pieces they share."""
