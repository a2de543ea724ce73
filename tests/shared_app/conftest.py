"""One Serve test app (tests/serve_test_app.py) for this package: the functional tests
(test_serve_app.py) and the faults (test_serve_faults.py). It starts once, for the first test that
asks for it, and stops after the package's last test: an app start of five engines takes minutes
on 2 cores. Neither module depends on the other having run: each module's ``app`` waits until
every engine answers /ready, and a fault test that kills a replica waits for its replacement
before it ends."""
from serve_test_app import app, baseline, client, reference, shared_app  # noqa: F401
