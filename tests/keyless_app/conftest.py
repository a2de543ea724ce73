"""One Serve app without API keys for this package (tests/keyless_test_app.py): the SDK and its
examples (test_sdk_e2e.py) and the LoRA decode groups (test_lora_groups.py). It starts once, for
the first test that asks for it, and stops after the package's last test."""
from keyless_test_app import app_url, keyless_app, keyless_models  # noqa: F401
