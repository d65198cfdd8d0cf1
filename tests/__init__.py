"""numa-infer's tests: one folder per package of numad_infer/ (tests/<package>/test_<module>.py),
the end-to-end tests in e2e/, the stand-ins the unit tests share in fakes.py."""
