"""Investigations that answered one past question, kept runnable (``python -m bench.lab.NAME``); what each
found is in bench/lab/README.md. Not part of ``python -m bench``."""
