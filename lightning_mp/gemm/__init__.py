"""Emulated 16-bit GEMMs for devices without 16-bit arithmetic, and their detection."""
