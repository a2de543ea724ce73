"""The SDK's and the LoRA decode groups' tests, on one app without API keys (see conftest.py)."""
