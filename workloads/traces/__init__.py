"""Trace files: a reader per supported format, detection from content, and summaries.

formats.read_trace is the entry point; readers raise only WorkloadError on bad input.
"""
