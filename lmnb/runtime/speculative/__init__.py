"""Speculative decoding (SGLang's NGRAM and STANDALONE): draft tokens proposed cheaply (an n-gram
index, `ngram.py`; a draft model, `draft_model.py`), sized and gated per request (`gate.py`,
`cost.py`) by the scheduler's `Speculator` (`speculator.py`), verified in one target forward per
step (`verify.py`)."""
