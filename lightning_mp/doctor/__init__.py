"""Measuring what 16 bits do: the overflow locator and its report, finite checks, log2 histograms, activation
ranges and the ranges picture."""
