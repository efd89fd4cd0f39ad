"""Target (Llama family) and drafter (EAGLE-3 / 3.1) models."""
