"""Model factorization: prefill modules (frozen bases), decode modules (task decoders), compatibility."""
