"""The functional and the fault tests of the Serve test app, on one app (see conftest.py)."""
