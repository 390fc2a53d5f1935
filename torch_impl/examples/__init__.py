"""Inputs made here, with nothing downloaded, for a first run (``moezero example``)."""
