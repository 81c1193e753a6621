"""Speculative decoding: draft tokens proposed cheaply (`ngram.py`), verified in one target
forward per request (`verify.py`), turned on and off per request and batch (`gate.py`)."""
