"""Tests that need a CUDA device (marker ``gpu``; skipped without one)."""
