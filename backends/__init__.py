"""Backend adapters, one folder per backend family (installed as turbo_dispatch.backends)."""
