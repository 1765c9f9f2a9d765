"""The model seam trainer and generation share: the policy (tokenizer, model, weights), its
weights as layer-sized chunks, and the tiny models tests and the embedded default make."""
