"""Building blocks of the decoder models (norms, rotary embedding, activations, linears)."""
