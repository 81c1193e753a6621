"""Model definitions (Llama family, LLaVA) and the weight loader."""
