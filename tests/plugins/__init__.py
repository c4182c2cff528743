"""A state format and an algorithm that exist only for the tests: each is one file plus one
registration, which is all a new codec or algorithm needs to train through the public API."""
